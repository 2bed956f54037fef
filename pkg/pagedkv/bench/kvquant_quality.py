"""``python -m pagedkv.bench kvquant-quality``: KV-mode quality on K/V from real model code.

docs/kv-quant.md "Quality" is this script's output. Models are mlx-lm's own Qwen3, Llama and
Gemma3 forwards (``pip install mlx-lm``; only this script needs it) with random weights, run
on text-like token streams (Zipf-distributed ids with repeated spans, so induction-like
copying exists). For every model and method:

* **attention error**: the queries, post-RoPE keys and values of every layer are captured
  from one forward (mlx-lm's ``scaled_dot_product_attention`` is wrapped); attention over
  the last ``--queries`` positions is recomputed in float64 from the exact K/V and from
  each method's round trip of the *same* tensors; the error is ``||O_q - O|| / ||O||`` over
  all layers, heads and positions. K only, V only, and both.
* **greedy agreement**: 256 tokens are generated greedily through mlx-lm with a float16 KV
  cache; each method then runs teacher-forced over the same sequence with its own cache
  (K/V round-tripped as stored), and the share of the 256 positions whose argmax equals
  the float16 run's token is reported (so one early flip does not decide the rest), with
  the mean KL divergence of the next-token distributions from the float16 run's.
* **memory**: bits per stored K/V element and bytes per token and layer vs float16.

Random weights make attention diffuse and logits flat; two knobs bring them closer to a
trained model and are printed with the results: the attention logits are multiplied by
``--attn-sharpness`` (q·k scale; K and V are unchanged) and the tied embedding, hence the
logits, by ``--logit-scale``. What they cannot add (outlier channels, attention sinks,
trained heads) is listed in docs/kv-quant.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedkv.bench.kv_peers import PEERS

__all__ = ["MODELS", "main", "measure"]

#: Small members of each family (head_dim as the real ones: 128, 128, 256), random weights.
MODELS: dict[str, dict] = {
    "qwen3": {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 4,
              "intermediate_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 4096,
              "max_position_embeddings": 8192, "rope_theta": 1000000.0,
              "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 4,
              "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": 4096, "rope_theta": 500000.0,
              "max_position_embeddings": 8192, "tie_word_embeddings": True},
    # all layers global (sliding_window_pattern 1): the window would hide K/V from the test
    "gemma3": {"model_type": "gemma3_text", "hidden_size": 1024, "num_hidden_layers": 4,
               "intermediate_size": 2048, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 4096,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 1, "max_position_embeddings": 8192},
}
_MODULES = {"qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class Method:
    """A K/V storage: ``bits(head_dim)`` per element; ``k``/``v``: round trips (None: exact)."""

    name: str
    bits: Callable[[int], float]
    k: Callable[[np.ndarray], np.ndarray] | None
    v: Callable[[np.ndarray], np.ndarray] | None


def _ours(mode: str) -> Callable[[np.ndarray], np.ndarray]:
    from pagedkv.quant import kv
    return lambda x: kv.decode(kv.encode(np.ascontiguousarray(x, np.float32), mode), mode,
                               x.shape[-1]).astype(np.float64)


def _record_bits(*modes: str) -> Callable[[int], float]:
    """Bits per stored element of pagedkv records of ``modes`` (averaged over the sides)."""
    from pagedkv.quant import kv
    return lambda d: sum(kv.side_row_bytes(m, d) for m in modes) * 8 / (d * len(modes))


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def side_methods(head_dim: int) -> list[Method]:
    """Every way to store one side (applied to K alone, V alone, or both)."""
    from pagedkv.quant import kv
    out = [Method("float16", lambda d: 16.0, _f16, _f16),
           Method("pagedkv q8", lambda d: 8.5, _ours("q8"), _ours("q8"))]
    for name in ("fwht4", "fwht3", "fwht2", "lloyd4", "lloyd3", "lloyd2"):
        mode = kv.kv_mode(name)
        if mode.supports(head_dim):
            rt = _ours(name)
            out.append(Method(f"pagedkv {name}", _record_bits(name), rt,
                              rt if mode.sides == "V" else None))
    for peer in PEERS.values():
        out.append(Method(peer.name, peer.bits, peer.roundtrip, peer.roundtrip))
    return out


def kv_pairs(head_dim: int) -> list[Method]:
    """K+V storages: pagedkv's pairs at this head_dim and each peer on both sides."""
    from pagedkv.quant import kv
    ks = [m for m in ("fwht4", "fwht3", "fwht2", "lloyd4", "lloyd2")
          if kv.kv_mode(m).supports(head_dim)]
    vs = ["q8"] + [m for m in ("lloyd4", "lloyd3", "lloyd2") if kv.kv_mode(m).supports(head_dim)]
    out = [Method("float16", lambda d: 16.0, _f16, _f16),
           Method("pagedkv q8", lambda d: 8.5, _ours("q8"), _ours("q8"))]
    for k in ks:
        for v in vs:
            out.append(Method(f"pagedkv {k}/{v}", _record_bits(k, v), _ours(k), _ours(v)))
    for peer in PEERS.values():
        out.append(Method(peer.name, peer.bits, peer.roundtrip, peer.roundtrip))
    return out


def token_stream(n: int, vocab: int, seed: int) -> np.ndarray:
    """Zipf-like ids (p ∝ 1/rank^1.1) where, a third of the time, a span of 4-24 earlier
    tokens is copied (repeated names and phrases, as in text)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    p /= p.sum()
    perm = rng.permutation(vocab)
    out: list[int] = []
    while len(out) < n:
        if len(out) > 32 and rng.random() < 1 / 3:
            span = int(rng.integers(4, 25))
            start = int(rng.integers(0, len(out) - span))
            out.extend(out[start:start + span])
        else:
            out.extend(perm[rng.choice(vocab, size=8, p=p)].tolist())
    return np.asarray(out[:n], np.int32)


def build_model(name: str, seed: int, attn_sharpness: float, logit_scale: float):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes
    cfg = dict(MODELS[name])
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    for layer in model.layers:
        attn = layer.self_attn
        attn.scale = attn.scale * attn_sharpness
    emb = model.model.embed_tokens
    emb.weight = emb.weight * logit_scale
    mx.eval(model.parameters())
    return model


class _Capture:
    """Wraps a model module's ``scaled_dot_product_attention`` and keeps (q, k, v, scale)."""

    def __init__(self, module_name: str) -> None:
        self.module = importlib.import_module(f"mlx_lm.models.{module_name}")
        self.calls: list[tuple] = []

    def __enter__(self):
        self.orig = self.module.scaled_dot_product_attention

        def wrapped(queries, keys, values, cache, scale, mask, **kw):
            self.calls.append((queries, keys, values, float(scale)))
            return self.orig(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        self.module.scaled_dot_product_attention = wrapped
        return self

    def __exit__(self, *exc):
        self.module.scaled_dot_product_attention = self.orig


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Causal attention of queries at ``positions`` (float64): q [H, L, d], k/v [KVH, L, d].
    Returns (outputs [H, Q, d], the max probability of each row)."""
    heads, kvh = q.shape[0], k.shape[0]
    group = heads // kvh
    qs = q[:, positions]
    kk = np.repeat(k, group, axis=0)
    vv = np.repeat(v, group, axis=0)
    logits = np.matmul(qs, kk.transpose(0, 2, 1)) * scale   # BLAS, not einsum's loops
    causal = np.arange(k.shape[1])[None, :] > positions[:, None]
    logits = np.where(causal[None], -np.inf, logits)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return np.matmul(p, vv), p.max(axis=-1)


def capture_layers(model, name: str, tokens: np.ndarray) -> list[tuple]:
    import mlx.core as mx
    with _Capture(_MODULES[name]) as cap:
        mx.eval(model(mx.array(tokens)[None]))
    return [(np.array(q[0], np.float64), np.array(k[0], np.float64), np.array(v[0], np.float64),
             s) for q, k, v, s in cap.calls]


def attention_errors(layers: list[tuple], methods: list[Method], n_queries: int,
                     which: str) -> dict[str, float]:
    """Relative attention-output error per method; ``which``: "k", "v" or "kv"."""
    errs = {m.name: [0.0, 0.0] for m in methods}
    for q, k, v, scale in layers:
        positions = np.arange(q.shape[1] - n_queries, q.shape[1])
        ref, _ = _attention(q, k, v, scale, positions)
        norm2 = float((ref ** 2).sum())
        for m in methods:
            if (which == "k" and m.k is None) or (which == "v" and m.v is None):
                continue
            kq = m.k(k) if which in ("k", "kv") and m.k else k
            vq = m.v(v) if which in ("v", "kv") and m.v else v
            out, _ = _attention(q, kq, vq, scale, positions)
            errs[m.name][0] += float(((out - ref) ** 2).sum())
            errs[m.name][1] += norm2
    return {n: np.sqrt(a / b) for n, (a, b) in errs.items() if b}


def _roundtrip_cache_class():
    from mlx_lm.models.cache import KVCache

    class RoundTripCache(KVCache):
        """mlx-lm's KVCache holding what a method stores: new K/V round-tripped first."""

        def __init__(self, method: Method) -> None:
            super().__init__()
            self.method = method

        def update_and_fetch(self, keys, values):
            import mlx.core as mx
            out = []
            for x, rt in ((keys, self.method.k), (values, self.method.v)):
                if rt is not None:
                    x = mx.array(rt(np.array(x.astype(mx.float32), np.float64))
                                 .astype(np.float32)).astype(x.dtype)
                out.append(x)
            return super().update_and_fetch(*out)

    return RoundTripCache


def greedy_agreement(model, prompt: np.ndarray, n_new: int, methods: list[Method]):
    """(float16 greedy tokens, {method: (share of positions whose teacher-forced argmax is
    the float16 token, mean KL(p_float16 || p_method) in nats)})."""
    import mlx.core as mx
    gen = importlib.import_module("mlx_lm.generate")
    cache_cls = _roundtrip_cache_class()
    f16 = next(m for m in methods if m.name == "float16")
    caches = [cache_cls(f16) for _ in model.layers]
    tokens = []
    for tok, _ in gen.generate_step(mx.array(prompt), model, max_tokens=n_new,
                                    prompt_cache=caches):
        tokens.append(int(tok))
    tokens_arr = np.asarray(tokens, np.int32)
    seq = np.concatenate([prompt, tokens_arr[:-1]])

    def logprobs(m: Method) -> np.ndarray:
        caches = [cache_cls(m) for _ in model.layers]
        logits = model(mx.array(seq)[None], cache=caches)[0, len(prompt) - 1:]
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), np.float64)

    base = logprobs(f16)
    out = {}
    for m in methods:
        lp = base if m is f16 else logprobs(m)
        kl = float((np.exp(base) * (base - lp)).sum(axis=-1).mean())
        out[m.name] = (float((lp.argmax(axis=-1) == tokens_arr).mean()), kl)
    return tokens_arr, out


def measure(model_names=("qwen3", "llama", "gemma3"), *, seq_len: int = 1024,
            n_queries: int = 128, n_new: int = 256, prompt_len: int = 256, seed: int = 0,
            attn_sharpness: float = 4.0, logit_scale: float = 8.0,
            greedy: bool = True) -> dict:
    """Every measurement of the module docstring, as a dict (what ``main`` prints)."""
    results: dict = {"settings": {"seq_len": seq_len, "queries": n_queries, "new_tokens": n_new,
                                  "prompt_len": prompt_len, "seed": seed,
                                  "attn_sharpness": attn_sharpness, "logit_scale": logit_scale},
                     "models": {}}
    for name in model_names:
        t0 = time.perf_counter()
        cfg = MODELS[name]
        model = build_model(name, seed, attn_sharpness, logit_scale)
        hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        tokens = token_stream(seq_len, cfg["vocab_size"], seed + 1)
        layers = capture_layers(model, name, tokens)
        pos = np.arange(seq_len - n_queries, seq_len)
        maxp = np.mean([_attention(q, k, v, s, pos)[1].mean() for q, k, v, s in layers])
        sides = side_methods(hd)
        pairs = kv_pairs(hd)
        r = {"head_dim": hd, "mean_max_attention_prob": float(maxp),
             "bits": {m.name: m.bits(hd) for m in sides + pairs},
             "k_only": attention_errors(layers, sides, n_queries, "k"),
             "v_only": attention_errors(layers, sides, n_queries, "v"),
             "kv": attention_errors(layers, pairs, n_queries, "kv")}
        if greedy:
            _, agree = greedy_agreement(model, tokens[:prompt_len], n_new, pairs)
            r["greedy_agreement"] = agree
        r["seconds"] = time.perf_counter() - t0
        results["models"][name] = r
    return results


def _table(rows: list[list[str]]) -> list[str]:
    head = "| " + " | ".join(rows[0]) + " |"
    sep = "|" + "|".join("---:" if i else "---" for i in range(len(rows[0]))) + "|"
    return [head, sep] + ["| " + " | ".join(r) + " |" for r in rows[1:]]


def report(results: dict) -> list[str]:
    """Markdown tables of ``results`` (one per model: sides, then K+V)."""
    lines = []
    for name, r in results["models"].items():
        hd = r["head_dim"]
        title = (f"### {name} (head_dim {hd}, mean max attention prob "
                 f"{r['mean_max_attention_prob']:.3f})")
        lines += [title, ""]
        rows = [["method", "bits/elem", "K only", "V only"]]
        for m, bits in r["bits"].items():
            if m in r["k_only"] or m in r["v_only"]:
                k, v = r["k_only"].get(m), r["v_only"].get(m)
                if "/" in m:
                    continue
                rows.append([m, f"{bits:.2f}", f"{k:.4f}" if k is not None else "-",
                             f"{v:.4f}" if v is not None else "-"])
        lines += _table(rows) + [""]
        rows = [["K+V", "bits/elem", "bytes/token/layer vs f16", "attention error",
                 "greedy agreement", "KL vs f16 (nats)"]]
        for m, err in r["kv"].items():
            bits = r["bits"][m]
            agree, kl = r.get("greedy_agreement", {}).get(m, (None, None))
            rows.append([m, f"{bits:.2f}", f"{bits / 16:.1%}", f"{err:.4f}",
                         f"{agree:.1%}" if agree is not None else "-",
                         f"{kl:.2e}" if kl is not None else "-"])
        lines += _table(rows) + [""]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench kvquant-quality",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3,llama,gemma3")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--queries", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-sharpness", type=float, default=4.0)
    p.add_argument("--logit-scale", type=float, default=8.0)
    p.add_argument("--no-greedy", action="store_true", help="skip the generation runs")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    try:
        importlib.import_module("mlx_lm")
    except ImportError:
        print("python -m pagedkv.bench kvquant-quality: needs mlx-lm (pip install mlx-lm)",
              file=sys.stderr)
        return 2
    names = tuple(n.strip() for n in args.models.split(",") if n.strip())
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"python -m pagedkv.bench kvquant-quality: unknown model(s) {unknown}; known: "
              f"{list(MODELS)}", file=sys.stderr)
        return 2
    results = measure(names, seq_len=args.seq_len, n_queries=args.queries,
                      n_new=args.new_tokens, prompt_len=args.prompt_len, seed=args.seed,
                      attn_sharpness=args.attn_sharpness, logit_scale=args.logit_scale,
                      greedy=not args.no_greedy)
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
