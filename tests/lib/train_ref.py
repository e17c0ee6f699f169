"""The head trainer's objective in numpy (float64), written apart from src/spec/train.c, for
gradient checks by central differences.

The objective (docs/HEADS.md, "Training"): for a sequence of L positions with tokens t,
target features h and the target's top-k next-token distributions P, the head's row p
(p = 0 .. L-2) reads t(p+1) and h(p) and, from row `first` on (earlier rows, the prompt's,
are context only), is scored against P(p+1), restricted to the draft
vocabulary and renormalised (cross-entropy), and against h(p+1) (smooth L1, beta 1, mean over
the width) times reg_weight. Pass j (0-based, unrolled training) scores rows p >= j fed with
pass j-1's feature of row p-1 instead of h(p), whose query attends, at each position q <= p,
to the key of pass max(0, j - (p - q)). Each pass's loss is the mean over its rows, weighted
by decay**j; the total is the sum over passes.

The trainer treats what pass j reads of earlier passes (their features g, keys and values) as
constants, so its gradient is that of this objective with those inputs held fixed: `loss`
takes `frozen` (the earlier passes' outputs at the base point) to differentiate the same thing.
"""
import math

import numpy as np

from lib.reference import apply_rope, rmsnorm, silu


def read_head(path, d):
    """The tensors of a tandem-layout head file as float64 arrays (fc split in halves)."""
    from safetensors.numpy import load_file
    t = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in load_file(str(path)).items()}
    t["fc_e"], t["fc_h"] = t["fc.weight"][:, :d], t["fc.weight"][:, d:]
    return t


def read_data(path, n_seqs, d, k):
    raw = open(path, "rb").read()
    off = 0

    def take(dtype, count):
        nonlocal off
        a = np.frombuffer(raw, dtype=dtype, count=count, offset=off)
        off += a.nbytes
        return a

    lens = take(np.int32, n_seqs)
    firsts = take(np.int32, n_seqs)
    seqs = []
    for L, first in zip(lens, firsts):
        L = int(L)
        tok = take(np.int32, L)
        feat = take(np.float32, L * d).reshape(L, d).astype(np.float64)
        ids = take(np.int32, L * k).reshape(L, k)
        pr = take(np.float32, L * k).reshape(L, k).astype(np.float64)
        seqs.append((tok, feat, ids, pr, int(first)))
    return seqs


def _smooth_l1(x):
    a = np.abs(x)
    return np.where(a < 1.0, 0.5 * x * x, a - 0.5)


def _pass(model, w, seq, j, prev, kv_of):
    """Pass j over one sequence: returns (g [rows, d], k [rows, nkv, hd], v, logits-ready g).
    prev: pass j-1's g of this sequence (rows p = j-1 .. L-2), or None for pass 0.
    kv_of(c): pass c's (K, V) of this sequence, rows p = c .. L-2."""
    m = model
    tok, feat = seq[0], seq[1]
    L = len(tok)
    ps = np.arange(j, L - 1)
    hd = m.head_dim
    nh, nkv = w["layers.0.self_attn.q_proj.weight"].shape[0] // hd, w["layers.0.self_attn.k_proj.weight"].shape[0] // hd
    e = m.embed[tok[ps + 1]]
    hin = feat[ps] if j == 0 else prev[ps - 1 - (j - 1)]
    x = rmsnorm(e, w["enorm.weight"], m.rms_eps) @ w["fc_e"].T + \
        rmsnorm(hin, w["hnorm.weight"], m.rms_eps) @ w["fc_h"].T
    a = rmsnorm(x, w["layers.0.input_layernorm.weight"], m.rms_eps)
    q = a @ w["layers.0.self_attn.q_proj.weight"].T
    k = a @ w["layers.0.self_attn.k_proj.weight"].T
    v = a @ w["layers.0.self_attn.v_proj.weight"].T
    if "layers.0.self_attn.q_proj.bias" in w:
        q = q + w["layers.0.self_attn.q_proj.bias"]
        k = k + w["layers.0.self_attn.k_proj.bias"]
        v = v + w["layers.0.self_attn.v_proj.bias"]
    R = len(ps)
    q, k, v = q.reshape(R, nh, hd), k.reshape(R, nkv, hd), v.reshape(R, nkv, hd)
    if "layers.0.self_attn.q_norm.weight" in w:
        q = rmsnorm(q, w["layers.0.self_attn.q_norm.weight"], m.rms_eps)
        k = rmsnorm(k, w["layers.0.self_attn.k_norm.weight"], m.rms_eps)
    q = apply_rope(q, ps, m.inv_freq, m.rope_neox)
    k = apply_rope(k, ps, m.inv_freq, m.rope_neox)
    out = np.zeros((R, nh, hd))
    grp = nh // nkv
    for i, p in enumerate(ps):
        keys, vals = [], []
        for qq in range(p + 1):
            c = max(0, j - (p - qq))
            if c == j:
                keys.append(k[qq - j]), vals.append(v[qq - j])
            else:
                Kc, Vc = kv_of(c)
                keys.append(Kc[qq - c]), vals.append(Vc[qq - c])
        K, Vv = np.stack(keys), np.stack(vals)  # [p+1, nkv, hd]
        for h in range(nh):
            s = K[:, h // grp] @ q[i, h] / math.sqrt(hd)
            s = np.exp(s - s.max())
            s /= s.sum()
            out[i, h] = s @ Vv[:, h // grp]
    x = x + out.reshape(R, nh * hd) @ w["layers.0.self_attn.o_proj.weight"].T
    mm = rmsnorm(x, w["layers.0.post_attention_layernorm.weight"], m.rms_eps)
    x = x + (silu(mm @ w["layers.0.mlp.gate_proj.weight"].T) * (mm @ w["layers.0.mlp.up_proj.weight"].T)) @ w["layers.0.mlp.down_proj.weight"].T
    g = rmsnorm(x, w["norm.weight"], m.rms_eps)
    return g, k, v


def loss(model, w, seqs, draft_vocab, *, reg_weight, unroll, decay, frozen=None):
    """The objective. frozen: None, or what the passes read of earlier passes (a list per pass
    of per-sequence (g, K, V)), held fixed. Returns (loss, computed) where computed is that
    list for this evaluation."""
    m = model
    dv = np.asarray(draft_vocab)
    t2d = {int(t): i for i, t in enumerate(dv)}
    lm = m.lm_head[dv]
    total = 0.0
    computed = []
    for j in range(unroll):
        per_seq, rows, acc = [], 0, 0.0
        for s, seq in enumerate(seqs):
            tok, feat, ids, pr, first = seq
            L = len(tok)
            src = frozen if frozen is not None else computed
            prev = src[j - 1][s][0] if j > 0 else None
            g, k, v = _pass(m, w, seq, j, prev, lambda c: src[c][s][1:])
            per_seq.append((g, k, v))
            ps = np.arange(j, L - 1)
            z = g @ lm.T
            z = z - z.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            for i, p in enumerate(ps):
                if p < first:
                    continue
                tgt = [(t2d[int(t)], float(q)) for t, q in zip(ids[p + 1], pr[p + 1])
                       if t >= 0 and int(t) in t2d]
                mass = sum(q for _, q in tgt)
                if mass > 0:
                    acc -= sum(q / mass * logp[i, c] for c, q in tgt)
            sc = ps >= first
            acc += reg_weight * _smooth_l1(g[sc] - feat[ps[sc] + 1]).mean(axis=1).sum()
            rows += int(sc.sum())
        computed.append(per_seq)
        if rows:
            total += decay ** j * acc / rows
    return total, computed
