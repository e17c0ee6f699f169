"""Deterministic tokenizer test corpus.

build_corpus() returns >= 2,000 str items covering what tokenizers get wrong: ASCII prose
with contractions, accents (precomposed and combining), CJK, emoji (ZWJ sequences, skin tones,
flags, variation selectors), runs of spaces/tabs/newlines (\\r\\n, trailing spaces, Unicode
spaces), digits and long numbers in several scripts, code, mixed scripts (Arabic, Hindi,
Cyrillic, Thai, Hebrew, Greek), special-token text embedded in prose, very long words, control
characters and the empty string. Seeded, so every run sees the same strings.

invalid_utf8() returns (bytes, offset of the first bad byte) pairs.
"""
import random

SEED = 20240611

WORDS = ("the quick brown fox jumps over lazy dog tokenizer byte pair encoding merges "
         "inference server model weights attention layer cache page request batch prefill "
         "decode sampling temperature probability vocabulary unicode normalisation hello "
         "world python rust kernel matrix vector Paris London Tokyo January Monday I you "
         "we they she he it a an of to in on at for with without because however").split()
CONTRACTIONS = ["don't", "it's", "I'm", "they'll", "we've", "she'd", "you're", "IT'S",
                "We'LL", "can't", "o'clock", "rock 'n' roll", "'s", "'t", "'re", "'ve", "'m",
                "'ll", "'d", "’s", "it’s", "'ſ", "'K", "'Ś"]
ACCENTS = ["café", "naïve", "résumé", "Ångström", "façade", "jalapeño", "Zürich", "Øresund",
           "Łódź", "Čeština", "ễ", "cafe\u0301", "n\u0303", "A\u030a", "e\u0301\u0301",
           "ǅemal", "ß", "ﬁ ligature", "İstanbul", "ĳ"]
CJK = ["你好，世界！", "这是一个测试。", "日本語のテキスト", "カタカナとひらがな", "漢字かな交じり文",
       "한국어 텍스트입니다", "中文標點：「引號」", "ｆｕｌｌｗｉｄｔｈ　ｓｐａｃｅ", "〇一二三", "㐀㐁𠀀𠀁"]
EMOJI = ["😀", "👍🏽", "👍🏿", "👋🏻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸", "🇯🇵🇫🇷", "❤️", "❤", "🧑🏾‍💻",
         "👩‍❤️‍💋‍👨", "🤷‍♀️", "1️⃣", "©️", "🙂🙃😉", "🦀🐍", "\U0001FAE0"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ",
          " \t ", "    ", "\u00a0", "\u3000", "\u2009", "\u202f", "\u2028", "\x0b", "\x0c",
          "\x85", "\u1680", "\u180e", "\u200b"]
NUMBERS = ["0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000",
           "-273.15", "1e-9", "0x1F", "2024-06-11", "12:30:45", "٣٤٥", "१२३", "１２３", "²³",
           "Ⅻ", "½", "௰", "๓๔", "99999999999999999999"]
CODE = [
    "def foo(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "<div class=\"x\">Hello &amp; <b>bye</b></div>",
    "SELECT * FROM users WHERE id = 42;",
    "fn main() { println!(\"hi {}\", 1 + 1); }",
    "#include <stdio.h>\nint main(void) { return 0; }\n",
    "x = [i*i for i in range(10) if i % 2 == 0]",
    "    if (a && b || !c) { return -1; }   ",
    "$ ls -la | grep '\\.py$' > out.txt 2>&1",
    "a += 1; b -= 2; c *= 3; d /= 4; e %= 5;",
    "matrix[i][j] = (i + j) ** 0.5",
]
SCRIPTS = ["مرحبا بالعالم", "السلام عليكم ورحمة الله", "नमस्ते दुनिया", "हिन्दी में लिखा गया पाठ",
           "Привет, мир!", "Съешь же ещё этих мягких французских булок", "สวัสดีชาวโลก",
           "ภาษาไทยไม่มีช่องว่าง", "שלום עולם", "Γειά σου Κόσμε", "ελληνικά", "Բարեւ աշխարհ",
           "ქართული", "ᚠᚢᚦᚨᚱᚲ", "ꦗꦮ", "Tiếng Việt có dấu"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>",
           "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<s>", "</s>", "<unk>",
           "<tool_call>", "<|im_start", "im_end|>", "<|", "|>", "<repo_name>", "<file_sep>"]
CONTROL = ["\x00", "\x01", "\x1b[31mred\x1b[0m", "\x7f", "\ufeff", "\u200d", "\ufffd",
           "\U0010FFFF", "\ue000", "\x1c\x1d"]

POOLS = [WORDS, CONTRACTIONS, ACCENTS, CJK, EMOJI, SPACES, NUMBERS, CODE, SCRIPTS, SPECIAL,
         CONTROL]


def _sentence(rng):
    n = rng.randint(3, 14)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
    s = " ".join(words)
    return s + rng.choice([".", "!", "?", ",", "", "...", ";", ":"])


def _mixed(rng):
    parts = []
    for _ in range(rng.randint(1, 8)):
        pool = rng.choice(POOLS)
        parts.append(rng.choice(pool))
        if rng.random() < 0.6:
            parts.append(rng.choice([" ", " ", "", "\n", "  ", "\t"]))
    return "".join(parts)


def _random_chars(rng):
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
              (0x900, 0x97F), (0xE00, 0xE7F), (0x1F300, 0x1F64F), (0x3040, 0x30FF),
              (0x4E00, 0x4FFF), (0xAC00, 0xAD00), (0x2000, 0x206F), (0x0, 0x1F)]
    out = []
    for _ in range(rng.randint(1, 40)):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def _special_in_text(rng):
    a, b = _sentence(rng), _sentence(rng)
    sp = rng.choice(SPECIAL)
    glue = rng.choice(["", " ", "\n"])
    return rng.choice([f"{a}{glue}{sp}{glue}{b}", f"{sp}{a}", f"{a}{sp}", f"{sp}{sp}{a}",
                       f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n{b}"])


def _whitespace(rng):
    s = rng.choice([_sentence(rng), rng.choice(WORDS), rng.choice(CODE)])
    pre = "".join(rng.choice(SPACES) for _ in range(rng.randint(0, 4)))
    post = "".join(rng.choice(SPACES) for _ in range(rng.randint(0, 4)))
    mid = "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 6)))
    return pre + s + mid + rng.choice(WORDS) + post


def _long(rng):
    kind = rng.randrange(8)
    n = rng.choice([300, 1000, 3000])
    if kind == 0:
        return "a" * n
    if kind == 1:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
    if kind == 2:
        return "".join(rng.choice("0123456789") for _ in range(n))
    if kind == 3:
        return " " * n + "x"
    if kind == 4:
        return "\n" * (n // 10) + "end"
    if kind == 5:
        return "😀" * (n // 10)
    if kind == 6:
        return "supercalifragilisticexpialidocious" * (n // 30)
    return "漢" * (n // 3)


def build_corpus(seed=SEED):
    rng = random.Random(seed)
    items = [""]
    for pool in POOLS:
        items.extend(pool)
    gens = [(_sentence, 500), (_mixed, 600), (_random_chars, 250), (_special_in_text, 200),
            (_whitespace, 250), (_long, 40)]
    for gen, count in gens:
        items.extend(gen(rng) for _ in range(count))
    # every number alone and inside text
    for num in NUMBERS:
        items.append(f"The value is {num} units.")
        items.append(f"{num}{num} {num}")
    # dedupe, keeping order
    seen, out = set(), []
    for s in items:
        if s not in seen:
            seen.add(s)
            out.append(s)
    assert len(out) >= 2000, len(out)
    return out


def invalid_utf8():
    """(bytes, offset of the first invalid byte)."""
    return [
        (b"\xff", 0),
        (b"abc\x80", 3),
        (b"\xc0\xaf", 0),                  # overlong '/'
        (b"ok \xe0\x80\xaf", 3),           # overlong 3-byte
        (b"\xed\xa0\x80", 0),              # UTF-16 surrogate
        (b"x\xf4\x90\x80\x80", 1),         # above U+10FFFF
        (b"\xe2\x82", 0),                  # truncated
        (b"hello \xe2\x82", 6),            # truncated at the end
        (b"\xf8\x88\x80\x80\x80", 0),      # 5-byte form
        (b"caf\xc3", 3),
        (b"\xc3\x28", 0),                  # bad continuation
        (b"good \xf0\x9f\x98\x80 bad \xfe", 14),
        ("<|im_start|>".encode() + b"\x80", 12),
    ]
