"""Tokenizers and chat templates against independent references.

The reference for every encoding is Hugging Face `tokenizers`, never tandem itself:
  1. SmolLM2 (the default model): an HF Tokenizer built from the GGUF's own vocab and merges
     (read with the `gguf` package) plus the pre-tokenizer SmolLM2 ships (Digits + ByteLevel);
     compared against our GGUF path, and against our tokenizer.json path on the file that HF
     Tokenizer writes.
  2. SentencePiece-style BPE: trained with `tokenizers` on the corpus (byte fallback, Llama-2
     normaliser; and a Metaspace variant), through tokenizer.json and through a GGUF written
     with gguf.GGUFWriter (scores = merge priorities).
  3. Llama-3-style and Qwen2-style byte-level BPE trained with `tokenizers`, through
     tokenizer.json and GGUF.
  4. Invalid UTF-8 gives the documented error.
  5. Chat templates rendered by jinja2 (as transformers sets it up) from the real template
     strings, compared byte for byte.
Encode is compared with and without special-token parsing; decode of the ids with and without
skipping special tokens.
"""
import base64
import functools
import json
import subprocess
import unicodedata

import pytest

import corpus
from conftest import build_dir, default_model_path

gguf = pytest.importorskip("gguf")
tk = pytest.importorskip("tokenizers")
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,  # noqa: E402
                        pre_tokenizers, trainers)
from lib.smol_hf import smol_hf_tokenizer, smol_metadata  # noqa: E402

TOOL = build_dir() / "tests" / "tools" / "tok_tool"

LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
             r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
            r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ---------------------------------------------------------------- helpers

def run_tool(args, lines, expect_rc=0):
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not built")
    data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines)
    cp = subprocess.run([str(TOOL)] + [str(a) for a in args], input=data.encode(),
                        capture_output=True, timeout=300)
    assert cp.returncode == expect_rc, (f"tok_tool {args} exited {cp.returncode}:\n"
                                        f"{cp.stderr.decode(errors='replace')[-3000:]}")
    # split on "\n" only: str.splitlines() would also cut at U+0085, U+001C, ...
    out = [json.loads(x) for x in cp.stdout.decode().split("\n") if x]
    assert len(out) == len(lines) or args[0] in ("pieces", "info")
    return out


def b64(s):
    return base64.b64decode(s).decode("utf-8", errors="replace")


def check_against_hf(hf, src, texts, special, bos=False, label=""):
    """Encodes `texts` with tok_tool and with the HF tokenizer; asserts identical ids and
    identical decoded text (special tokens kept and skipped)."""
    hf.encode_special_tokens = not special
    ref = hf.encode_batch(texts, add_special_tokens=bos)
    args = ["encode", src] + (["--special"] if special else []) + (["--bos"] if bos else [])
    ours = run_tool(args, texts)
    bad = []
    for s, r, o in zip(texts, ref, ours):
        assert "error" not in o, (repr(s[:80]), o)
        if r.ids != o["ids"]:
            bad.append((s, r.ids, o["ids"]))
            continue
        for skip, key in ((False, "dec"), (True, "dec_skip")):
            want = hf.decode(r.ids, skip_special_tokens=skip)
            got = b64(o[key])
            if want != got:
                bad.append((s, f"decode skip={skip}", want, got))
    detail = "\n".join(repr(b)[:400] for b in bad[:5])
    assert not bad, f"{label} special={special}: {len(bad)}/{len(texts)} differ:\n{detail}"


@pytest.fixture(scope="module")
def texts():
    return corpus.build_corpus()


def gguf_strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def gguf_ints(reader, key):
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def write_gguf(path, model, tokens, types, *, merges=None, scores=None, pre=None, bos=None,
               eos=None, unk=None, add_bos=None, add_space_prefix=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    if unk is not None:
        w.add_unk_token_id(unk)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ordered_vocab(hf_json):
    """Token texts by id from a tokenizer.json dict (model vocab plus added tokens)."""
    by_id = {i: t for t, i in hf_json["model"]["vocab"].items()}
    for a in hf_json["added_tokens"]:
        by_id[a["id"]] = a["content"]
    assert sorted(by_id) == list(range(len(by_id)))
    return [by_id[i] for i in range(len(by_id))]


def merge_pairs(hf_json):
    out = []
    for m in hf_json["model"]["merges"]:
        out.append(tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)))
    return out


# ---------------------------------------------------------------- 1. SmolLM2

@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"default model missing at {path}")
    meta = smol_metadata()
    tokens, types = meta["tokens"], meta["types"]
    assert meta["pre"] == "smollm"
    assert len(set(tokens)) == len(tokens)
    hf = smol_hf_tokenizer()
    specials = [tokens[i] for i, t in enumerate(types) if t == 3]
    assert "<|im_start|>" in specials and "<|endoftext|>" in specials
    d = tmp_path_factory.mktemp("smol")
    hf.save(str(d / "tokenizer.json"))
    return {"hf": hf, "gguf": path, "json": d / "tokenizer.json", "tokens": tokens}


@pytest.mark.parametrize("special", [False, True])
def test_smollm2_gguf_matches_hf(smol, texts, special):
    check_against_hf(smol["hf"], smol["gguf"], texts, special, label="smollm2 gguf")


@pytest.mark.parametrize("special", [False, True])
def test_smollm2_tokenizer_json_matches_hf(smol, texts, special):
    check_against_hf(smol["hf"], smol["json"], texts, special, label="smollm2 json")


def test_smollm2_info_and_pieces(smol):
    info = run_tool(["info", smol["gguf"]], [])[0]
    assert info == {"kind": "bpe_bytes", "vocab_size": len(smol["tokens"]), "bos": 1, "eos": 2,
                    "adds_bos": False}
    pieces = run_tool(["pieces", smol["gguf"]], [])
    hf = smol["hf"]
    for i in range(0, len(pieces), 7):  # a spread of tokens, specials included
        raw = base64.b64decode(pieces[i]["b64"])
        assert raw.decode("utf-8", errors="replace") == hf.decode([i], skip_special_tokens=False)
        assert pieces[i]["special"] == (i <= 16)


def test_smollm2_bos_flag(smol):
    out = run_tool(["encode", smol["gguf"], "--bos"], ["hi"])[0]
    assert out["ids"][0] == 1 and len(out["ids"]) > 1


# ---------------------------------------------------------------- 2. SentencePiece-style BPE

SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
LLAMA2_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": "\u2581"},
    {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
LLAMA2_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
BOS_TEMPLATE = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                         {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}


@pytest.fixture(scope="module")
def spm(tmp_path_factory, texts):
    """A small SPM-style BPE: trained on words split at U+2581 (as SentencePiece does), with
    a limited alphabet so that byte fallback is exercised, then laid out like Llama 2: <unk>,
    <s>, </s>, <0x00>..<0xFF>, then the learned pieces."""
    tr = Tokenizer(models.BPE(unk_token="<unk>"))
    tr.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always",
                                                split=True)
    tr.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPM_SPECIALS, limit_alphabet=120, show_progress=False))
    j = json.loads(tr.to_str())
    base = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)]
    # jansson cannot hold NUL in object keys: leave the NUL character to byte fallback
    learned = [t for t, _ in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
               if t not in base and "\x00" not in t]
    tokens = base + learned
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [m for m in j["model"]["merges"] if "\x00" not in "".join(m)]
    j["model"].update(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True)
    for a in j["added_tokens"]:
        a["id"] = vocab[a["content"]]
    j.update(normalizer=LLAMA2_NORMALIZER, pre_tokenizer=None, decoder=LLAMA2_DECODER,
             post_processor=BOS_TEMPLATE)
    d = tmp_path_factory.mktemp("spm")
    (d / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False))
    hf = Tokenizer.from_str(json.dumps(j))

    # the same model as GGUF: a merged token scores -(rank of the merge that made it) - 1
    rank = {}
    for r, (a, b) in enumerate(merge_pairs(j)):
        rank.setdefault(a + b, r)
    scores = [-float(rank[t]) - 1.0 if t in rank else 0.0 for t in tokens]
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    write_gguf(d / "spm.gguf", "llama", tokens, types, scores=scores, bos=1, eos=2, unk=0,
               add_bos=True, add_space_prefix=True)

    # Metaspace variant (newer Llama/Mistral tokenizer.json): prepend "first", split words
    jm = dict(j, normalizer=None, pre_tokenizer={
        "type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True})
    (d / "meta").mkdir()
    (d / "meta" / "tokenizer.json").write_text(json.dumps(jm, ensure_ascii=False))
    return {"hf": hf, "json": d / "tokenizer.json", "gguf": d / "spm.gguf",
            "meta_hf": Tokenizer.from_str(json.dumps(jm)),
            "meta_json": d / "meta" / "tokenizer.json"}


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("src", ["json", "gguf"])
def test_spm_matches_hf(spm, texts, special, src):
    check_against_hf(spm["hf"], spm[src], texts, special, bos=True, label=f"spm {src}")


@pytest.mark.parametrize("special", [False, True])
def test_spm_metaspace_matches_hf(spm, texts, special):
    check_against_hf(spm["meta_hf"], spm["meta_json"], texts, special, label="spm metaspace")


def test_spm_byte_fallback_used(spm):
    # characters outside the limited alphabet must come out as <0xXX> tokens
    out = run_tool(["encode", spm["gguf"]], ["ꦗꦮ 𠀀"])[0]
    ref = spm["hf"].encode("ꦗꦮ 𠀀", add_special_tokens=False)
    assert out["ids"] == ref.ids
    assert any(t.startswith("<0x") for t in ref.tokens)
    for src in ("json", "gguf"):
        info = run_tool(["info", spm[src]], [])[0]
        assert info["kind"] == "spm" and info["bos"] == 1 and info["adds_bos"] is True


# ---------------------------------------------------------------- 3. Llama 3 / Qwen2 style

L3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
               "<|end_header_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_byte_level(texts, regex, specials, vocab_size):
    tr = Tokenizer(models.BPE())
    tr.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tr.decoder = decoders.ByteLevel()
    tr.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # a non-special added token, which is split out of text even without special parsing
    tr.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    return json.loads(tr.to_str())


def export_byte_level(j, path, pre, bos, add_bos):
    tokens = ordered_vocab(j)
    types = [1] * len(tokens)
    for a in j["added_tokens"]:
        types[a["id"]] = 3 if a["special"] else 4
    merges = [f"{a} {b}" for a, b in merge_pairs(j)]
    write_gguf(path, "gpt2", tokens, types, merges=merges, pre=pre, bos=bos, eos=None,
               add_bos=add_bos)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, texts):
    j = train_byte_level(texts, LLAMA3_RE, L3_SPECIALS, 3000)
    j["model"]["ignore_merges"] = True
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
         "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                  {"Sequence": {"id": "A", "type_id": 0}},
                  {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [0],
                                                  "tokens": ["<|begin_of_text|>"]}}}]}
    d = tmp_path_factory.mktemp("llama3")
    (d / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    export_byte_level(j, d / "l3.gguf", "llama-bpe", bos=0, add_bos=True)
    return {"hf": Tokenizer.from_str(json.dumps(j)), "json": d / "tokenizer.json",
            "gguf": d / "l3.gguf"}


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, texts):
    j = train_byte_level(texts, QWEN2_RE, QWEN_SPECIALS, 3000)
    j["normalizer"] = {"type": "NFC"}
    d = tmp_path_factory.mktemp("qwen2")
    (d / "tokenizer.json").write_text(json.dumps(j, ensure_ascii=False))
    export_byte_level(j, d / "q2.gguf", "qwen2", bos=None, add_bos=False)
    return {"hf": Tokenizer.from_str(json.dumps(j)), "json": d / "tokenizer.json",
            "gguf": d / "q2.gguf"}


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("src", ["json", "gguf"])
def test_llama3_style_matches_hf(llama3, texts, special, src):
    check_against_hf(llama3["hf"], llama3[src], texts, special, bos=True, label=f"llama3 {src}")


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("src", ["json", "gguf"])
def test_qwen2_style_matches_hf(qwen2, texts, special, src):
    # our NFC normaliser is a documented no-op: compare on NFC text
    nfc = list(dict.fromkeys(unicodedata.normalize("NFC", s) for s in texts))
    check_against_hf(qwen2["hf"], qwen2[src], nfc, special, label=f"qwen2 {src}")


def test_llama3_info(llama3):
    info = run_tool(["info", llama3["json"]], [])[0]
    eot = llama3["hf"].token_to_id("<|eot_id|>")
    assert info == {"kind": "bpe_bytes", "vocab_size": llama3["hf"].get_vocab_size(),
                    "bos": 0, "eos": eot, "adds_bos": True}


def test_non_special_added_token_always_split(llama3):
    hf = llama3["hf"]
    tid = hf.token_to_id("<tool_call>")
    for special in ([], ["--special"]):
        out = run_tool(["encode", llama3["json"]] + special, ["a<tool_call>b"])[0]
        assert tid in out["ids"]


# ---------------------------------------------------------------- 4. invalid UTF-8

def test_invalid_utf8_is_a_clear_error(smol, spm):
    cases = corpus.invalid_utf8()
    lines = [{"b64": base64.b64encode(b).decode()} for b, _ in cases] + ["fine"]
    for src in (smol["gguf"], spm["json"]):
        out = run_tool(["encode", src], lines, expect_rc=2)
        for (b, off), o in zip(cases, out):
            assert o.get("status") == "invalid argument", (b, o)
            assert o["error"] == f"tokenizer: invalid UTF-8 at byte offset {off}", (b, o)
        assert "ids" in out[-1]


# ---------------------------------------------------------------- 5. chat templates

# Meta-Llama-3-8B-Instruct's template, as in its tokenizer_config.json
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

# Qwen2.5-Instruct's template (tokenizer_config.json, JSON-decoded): Jinja string escapes
# such as \n stay escaped inside the literals.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "  Be nice.\n"}, {"role": "user", "content": "\n\tpad  "},
     {"role": "assistant", "content": " sure \u3000"}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "Ünïcödé ✓ 你好 👨‍👩‍👧"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "a<|im_end|>b<|eot_id|>c"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
    [{"role": "user", "content": "  \x1c trailing python-space \x85"}],
]


def jinja_render(template, messages, add_generation_prompt, **extra):
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages,
                                            add_generation_prompt=add_generation_prompt,
                                            **extra)


def smollm2_template():
    return smol_metadata()["chat_template"]


@pytest.mark.parametrize("which", ["smollm2", "llama3", "qwen25"])
def test_chat_templates_match_jinja(tmp_path, which):
    if which == "smollm2":
        template, src, extra = smollm2_template(), default_model_path(), {}
    else:
        template = LLAMA3_TEMPLATE if which == "llama3" else QWEN25_TEMPLATE
        src = tmp_path / "template.jinja"
        src.write_text(template)
        extra = {"bos_token": "<|begin_of_text|>"} if which == "llama3" else {}
    lines = [{"messages": m, "add_generation_prompt": g}
             for m in CONVERSATIONS for g in (False, True)]
    out = run_tool(["chat", src], lines)
    for line, o in zip(lines, out):
        want = jinja_render(template, line["messages"], line["add_generation_prompt"], **extra)
        assert o["text"] == want, (which, line, o["text"], want)
    defaults = {"smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                "qwen25": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                "llama3": None}
    assert out[0].get("default_system") == defaults[which]


def test_chat_unknown_template_is_unsupported(tmp_path):
    src = tmp_path / "t.jinja"
    src.write_text("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    cp = subprocess.run([str(TOOL), "chat", str(src)], input=b"", capture_output=True)
    assert cp.returncode == 1 and b"not ChatML or Llama 3" in cp.stderr
