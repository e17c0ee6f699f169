"""An HF `tokenizers` tokenizer for the default model, built from the GGUF's vocabulary and
merges with SmolLM2's pre-tokenizer (individual digits, then GPT-2 byte-level): the independent
reference that tandem's tokenizer is checked against."""
import functools

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from lib.server import default_model_path


def _strings(r, key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


@functools.lru_cache(maxsize=1)
def smol_metadata():
    """The default model's tokenizer metadata, read once (GGUFReader takes seconds)."""
    r = gguf.GGUFReader(str(default_model_path()))
    f = r.fields["tokenizer.ggml.token_type"]
    return {"tokens": _strings(r, "tokenizer.ggml.tokens"),
            "merges": _strings(r, "tokenizer.ggml.merges"),
            "types": [int(f.parts[i][0]) for i in f.data],
            "pre": bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode(),
            "chat_template": bytes(r.fields["tokenizer.chat_template"].parts[-1]).decode()}


@functools.lru_cache(maxsize=1)
def smol_hf_tokenizer():
    meta = smol_metadata()
    tokens, merges, types = meta["tokens"], meta["merges"], meta["types"]
    vocab = {t: i for i, t in enumerate(tokens)}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    hf.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(types) if t == 3]
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return hf
