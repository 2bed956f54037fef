"""``python -m pagedkv.bench kvquant-quality``: KV-mode quality on K/V from real model code.

docs/kv-quant.md "Quality" is this script's output. Models are mlx-lm's own Qwen3, Llama and
Gemma3 forwards (``pip install mlx-lm``; only this script needs it) with random weights, run
on text-like token streams (Zipf-distributed ids with repeated spans, so induction-like
copying exists). For every model and method:

* **attention error**: the queries, post-RoPE keys and values of every layer are captured
  from one forward (mlx-lm's ``scaled_dot_product_attention`` is wrapped); attention over
  the last ``--queries`` positions is recomputed in float64 from the exact K/V and from
  each method's round trip of the *same* tensors; the error is ``||O_q - O|| / ||O||`` over
  all layers, heads and positions. K only, V only, and both. Each side codec round-trips
  each tensor once and the softmax of each K codec is computed once, then shared by every
  pair that uses it (:func:`attention_errors`).
* **greedy agreement**: ``--new-tokens`` tokens are generated greedily through mlx-lm with
  a float16 KV cache; each K+V method then runs teacher-forced over the same sequence with
  its own cache (K/V round-tripped as stored), and the share of the generated positions
  whose argmax equals the float16 run's token is reported (so one early flip does not
  decide the rest), with the mean KL divergence of the next-token distributions from the
  float16 run's.
* **memory**: bits per stored K/V element and bytes per token and layer vs float16.

``--quick`` (2 layers, 256 tokens, 32 generated) checks the pipeline in about a minute;
the default ``--full`` setting (4 layers, 1024 tokens, 256 generated) is the published one.

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
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

if "numpy" not in sys.modules:
    # Run as the script: one BLAS thread. The matmuls here are small, and on a loaded
    # 2-core machine OpenBLAS's second thread made them 3x slower (spinning for a core).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from pagedkv.bench.kv_peers import PAIRS, PEERS

__all__ = ["MODELS", "SETTINGS", "Codec", "Pair", "attention_errors", "codecs", "main",
           "measure", "pairs", "report"]

#: Small members of each family with their real attention geometry (head_dim 128, 128, 256;
#: query heads per kv-head 2, 4, 2) and narrow everything else (hidden 512, vocab 2048), so
#: the forwards stay cheap on a CPU; random weights. The layer count comes from the setting.
MODELS: dict[str, dict] = {
    "qwen3": {"model_type": "qwen3", "hidden_size": 512, "intermediate_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 128, "rms_norm_eps": 1e-6, "vocab_size": 2048,
              "max_position_embeddings": 8192, "rope_theta": 1000000.0,
              "tie_word_embeddings": False},
    "llama": {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
              "rms_norm_eps": 1e-5, "vocab_size": 2048, "rope_theta": 500000.0,
              "max_position_embeddings": 8192, "tie_word_embeddings": False},
    # all layers global (sliding_window_pattern 1): the window would hide K/V from the test
    "gemma3": {"model_type": "gemma3_text", "hidden_size": 512, "intermediate_size": 1024,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 256, "rms_norm_eps": 1e-6, "vocab_size": 2048,
               "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 1, "max_position_embeddings": 8192},
}
_MODULES = {"qwen3": "qwen3", "llama": "llama", "gemma3": "gemma3_text"}

#: ``--quick`` and ``--full`` (the default): layers, tokens per stream, queries measured,
#: tokens generated and the prompt they follow.
SETTINGS: dict[str, dict[str, int]] = {
    "quick": {"layers": 2, "seq_len": 256, "n_queries": 32, "n_new": 32, "prompt_len": 64},
    "full": {"layers": 4, "seq_len": 1024, "n_queries": 128, "n_new": 256, "prompt_len": 256},
}


@dataclass(frozen=True)
class Codec:
    """One side's storage: ``bits(head_dim)`` per element, ``roundtrip`` (float rows in,
    what attention reads out), and the sides it may store (``"KV"``, ``"K"``, ``"V"``)."""

    name: str
    bits: Callable[[int], float]
    roundtrip: Callable[[np.ndarray], np.ndarray]
    sides: str = "KV"


@dataclass(frozen=True)
class Pair:
    """A K+V storage: the names of its K and V codecs."""

    name: str
    k: str
    v: str


def _ours(mode: str) -> Callable[[np.ndarray], np.ndarray]:
    from pagedkv.quant import kv
    return lambda x: kv.decode(kv.encode(np.ascontiguousarray(x, np.float32), mode), mode,
                               x.shape[-1]).astype(np.float64)


def _unbiased(mode: str) -> Callable[[np.ndarray], np.ndarray]:
    """``mode``'s records with another ``cnorm``: ``norm / (C[code] · r)`` instead of
    ``norm / ||C[code]||``, so the decoded row's projection on the input is the input's
    length (the stored length then carries no shrinkage; same bytes otherwise). Measured
    only (``*`` rows), docs/kv-quant.md "Quality"."""
    rt = _ours(mode)

    def roundtrip(x: np.ndarray) -> np.ndarray:
        y = rt(x)
        dot = (y * x).sum(axis=-1, keepdims=True)
        scale = np.where(dot > 0, (x * x).sum(axis=-1, keepdims=True) / np.where(
            dot > 0, dot, 1.0), 1.0)
        return y * scale.astype(np.float32).astype(np.float64)   # cnorm stays a float32
    return roundtrip


def _record_bits(mode: str) -> Callable[[int], float]:
    from pagedkv.quant import kv
    return lambda d: kv.side_row_bytes(mode, d) * 8 / d


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def codecs(head_dim: int) -> dict[str, Codec]:
    """Every side codec measured at ``head_dim``: float16, pagedkv's modes and the peers,
    each on both sides (fwhtN on V is pagedkv's V extension, docs/kv-quant.md "Modes")."""
    from pagedkv.quant import kv
    out = [Codec("float16", lambda d: 16.0, _f16), Codec("pagedkv q8", _record_bits("q8"),
                                                          _ours("q8"))]
    for name in ("fwht4", "fwht3", "fwht2", "lloyd4", "lloyd3", "lloyd2"):
        if kv.kv_mode(name).supports(head_dim):
            out.append(Codec(f"pagedkv {name}", _record_bits(name), _ours(name)))
    for name in ("fwht4", "lloyd4", "lloyd3"):
        if kv.kv_mode(name).supports(head_dim):
            out.append(Codec(f"pagedkv {name} ub *", _record_bits(name), _unbiased(name)))
    out += [Codec(p.name, p.bits, p.roundtrip) for p in PEERS.values()]
    return {c.name: c for c in out}


def pairs(head_dim: int) -> list[Pair]:
    """K+V storages at ``head_dim``: pagedkv's pool dtypes (where no lloyd V exists, the
    fwht V modes; the unbiased-cnorm variants, not pool dtypes, marked ``*``), each one-side
    peer on both sides, and vLLM's turboquant presets."""
    from pagedkv.quant import kv
    ks = [m for m in ("fwht4", "fwht3", "fwht2", "lloyd4")
          if kv.kv_mode(m).supports(head_dim)]
    vs = ["q8"] + [m for m in ("lloyd4", "lloyd3", "lloyd2") if kv.kv_mode(m).supports(head_dim)]
    if len(vs) == 1:  # no lloyd V at this head_dim (128): pagedkv's fwht V modes
        vs += ["fwht4", "fwht2"]
    out = [Pair("float16", "float16", "float16"), Pair("pagedkv q8", "pagedkv q8", "pagedkv q8")]
    out += [Pair(f"pagedkv {k}/{v}", f"pagedkv {k}", f"pagedkv {v}") for k in ks for v in vs]
    if not kv.kv_mode("lloyd4").supports(head_dim):
        out.append(Pair("pagedkv fwht4 ub/fwht4 ub *", "pagedkv fwht4 ub *",
                        "pagedkv fwht4 ub *"))
    else:
        out += [Pair(f"pagedkv {m} ub/{m} ub *", f"pagedkv {m} ub *", f"pagedkv {m} ub *")
                for m in ("lloyd4", "lloyd3")]
    out += [Pair(n, n, n) for n in PEERS]
    out += [Pair(n, k, v) for n, (k, v) in PAIRS.items()]
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


def build_model(name: str, layers: int, seed: int, attn_sharpness: float,
                logit_scale: float):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes
    cfg = dict(MODELS[name], num_hidden_layers=layers)
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    for layer in model.layers:
        attn = layer.self_attn
        attn.scale = attn.scale * attn_sharpness
    # Untied heads (qwen3, llama): scale the output head only. A tied random embedding
    # scaled up makes the residual stream predict its own input token whatever attention
    # does (greedy agreement 100% for every method). gemma3 ties always; its embedding is
    # scaled, and the forward multiplies inputs by sqrt(hidden) anyway.
    head = getattr(model, "lm_head", None) or model.model.embed_tokens
    head.weight = head.weight * logit_scale
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


def capture_layers(model, name: str, tokens: np.ndarray) -> list[tuple]:
    """One forward over ``tokens``: per layer (q [H, L, d], k, v [KVH, L, d] float64,
    softmax scale)."""
    import mlx.core as mx
    with _Capture(_MODULES[name]) as cap:
        mx.eval(model(mx.array(tokens)[None]))
    return [(np.array(q[0].astype(mx.float32), np.float64),
             np.array(k[0].astype(mx.float32), np.float64),
             np.array(v[0].astype(mx.float32), np.float64), s) for q, k, v, s in cap.calls]


def _softmax_rows(q: np.ndarray, k: np.ndarray, scale: float,
                  positions: np.ndarray) -> np.ndarray:
    """Causal attention probabilities, float64. ``q``: [KVH, G*Q, d], query heads grouped
    by the kv-head they read (row ``g*Q + j`` is query ``positions[j]``); ``k``: [KVH, L, d].
    Returns [KVH, G*Q, L]."""
    logits = np.matmul(q, k.transpose(0, 2, 1)) * scale   # BLAS, not einsum's loops
    group = q.shape[1] // len(positions)
    causal = np.arange(k.shape[1])[None, :] > np.tile(positions, group)[:, None]
    logits[:, causal] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    return p


def attention_errors(layers: Sequence[tuple], sides: dict[str, Codec], kv_pairs: list[Pair],
                     n_queries: int) -> dict:
    """``||O_method - O|| / ||O||`` over all layers, heads and the last ``n_queries``
    positions: ``{"k_only": {codec: err}, "v_only": {...}, "kv": {pair: err},
    "mean_max_attention_prob": float}``. ``layers``: (q [H, L, d], k, v [KVH, L, d],
    scale) as :func:`capture_layers` returns. Each codec round-trips each tensor once and
    each K codec's softmax is computed once."""
    k_names = [n for n, c in sides.items() if "K" in c.sides]
    v_names = [n for n, c in sides.items() if "V" in c.sides]
    by_k: dict[str, list[Pair]] = {}
    for p in kv_pairs:
        by_k.setdefault(p.k, []).append(p)
    sq = {"k_only": dict.fromkeys(k_names, 0.0), "v_only": dict.fromkeys(v_names, 0.0),
          "kv": {p.name: 0.0 for p in kv_pairs}}
    norm2, maxp = 0.0, []
    for q, k, v, scale in layers:
        kvh, length, d = k.shape
        positions = np.arange(length - n_queries, length)
        qg = q[:, positions].reshape(kvh, -1, d)   # head h reads kv-head h // group
        p_ref = _softmax_rows(qg, k, scale, positions)
        ref = np.matmul(p_ref, v)
        norm2 += float((ref ** 2).sum())
        maxp.append(float(p_ref.max(axis=-1).mean()))
        v_rt = {n: sides[n].roundtrip(v) for n in {p.v for p in kv_pairs} | set(v_names)}
        for n in v_names:
            sq["v_only"][n] += float(((np.matmul(p_ref, v_rt[n]) - ref) ** 2).sum())
        for n in dict.fromkeys(k_names + list(by_k)):
            p_q = _softmax_rows(qg, sides[n].roundtrip(k), scale, positions)
            if n in sq["k_only"]:
                sq["k_only"][n] += float(((np.matmul(p_q, v) - ref) ** 2).sum())
            for pair in by_k.get(n, ()):
                sq["kv"][pair.name] += float(((np.matmul(p_q, v_rt[pair.v]) - ref) ** 2).sum())
    out: dict = {key: {n: float(np.sqrt(s / norm2)) for n, s in errs.items()}
                 for key, errs in sq.items()}
    out["mean_max_attention_prob"] = float(np.mean(maxp))
    return out


def _roundtrip_cache_class():
    from mlx_lm.models.cache import KVCache

    class RoundTripCache(KVCache):
        """mlx-lm's KVCache holding what a method stores: new K/V round-tripped first."""

        def __init__(self, k: Codec, v: Codec) -> None:
            super().__init__()
            self.codecs = (k, v)

        def update_and_fetch(self, keys, values):
            import mlx.core as mx
            out = []
            for x, codec in zip((keys, values), self.codecs, strict=True):
                rt = codec.roundtrip(np.array(x.astype(mx.float32), np.float64))
                out.append(mx.array(rt.astype(np.float32)).astype(x.dtype))
            return super().update_and_fetch(*out)

    return RoundTripCache


def greedy_agreement(model, prompt: np.ndarray, n_new: int, sides: dict[str, Codec],
                     kv_pairs: list[Pair]) -> tuple[np.ndarray, dict]:
    """(float16 greedy tokens, {pair: (share of positions whose teacher-forced argmax is
    the float16 token, mean KL(p_float16 || p_method) in nats)}); the dict also holds
    ``"mean_max_next_token_prob"`` of the float16 run (how peaked the logits are)."""
    import mlx.core as mx
    gen = importlib.import_module("mlx_lm.generate")
    cache_cls = _roundtrip_cache_class()
    f16 = sides["float16"]
    caches = [cache_cls(f16, f16) for _ in model.layers]
    tokens = [int(tok) for tok, _ in gen.generate_step(mx.array(prompt), model,
                                                       max_tokens=n_new, prompt_cache=caches)]
    tokens_arr = np.asarray(tokens, np.int32)
    seq = mx.array(np.concatenate([prompt, tokens_arr[:-1]]))[None]

    def logprobs(k: Codec, v: Codec) -> np.ndarray:
        logits = model(seq, cache=[cache_cls(k, v) for _ in model.layers])[0, len(prompt) - 1:]
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), np.float64)

    base = logprobs(f16, f16)
    out: dict = {"mean_max_next_token_prob": float(np.exp(base.max(axis=-1)).mean())}
    for pair in kv_pairs:
        lp = base if pair.name == "float16" else logprobs(sides[pair.k], sides[pair.v])
        kl = float((np.exp(base) * (base - lp)).sum(axis=-1).mean())
        out[pair.name] = (float((lp.argmax(axis=-1) == tokens_arr).mean()), kl)
    return tokens_arr, out


def measure(model_names: Sequence[str] = ("qwen3", "llama", "gemma3"), *,
            setting: str = "full", seed: int = 0, attn_sharpness: float = 4.0,
            logit_scale: float = 8.0, greedy: bool = True) -> dict:
    """Every measurement of the module docstring, as a dict (what ``main`` prints)."""
    s = SETTINGS[setting]
    results: dict = {"settings": {"setting": setting, **s, "seed": seed,
                                  "attn_sharpness": attn_sharpness,
                                  "logit_scale": logit_scale},
                     "machine": f"{platform.machine()}, {platform.system()}",
                     "models": {}}
    for name in model_names:
        t0 = time.perf_counter()
        cfg = MODELS[name]
        model = build_model(name, s["layers"], seed, attn_sharpness, logit_scale)
        hd = cfg["head_dim"]
        tokens = token_stream(s["seq_len"], cfg["vocab_size"], seed + 1)
        sides, kv_pairs = codecs(hd), pairs(hd)
        layers = capture_layers(model, name, tokens)
        t1 = time.perf_counter()
        errs = attention_errors(layers, sides, kv_pairs, s["n_queries"])
        t2 = time.perf_counter()
        r = {"head_dim": hd, "mean_max_attention_prob": errs.pop("mean_max_attention_prob"),
             "side_bits": {n: c.bits(hd) for n, c in sides.items()},
             "bits": {p.name: (sides[p.k].bits(hd) + sides[p.v].bits(hd)) / 2
                      for p in kv_pairs}, **errs}
        if greedy:
            _, agree = greedy_agreement(model, tokens[:s["prompt_len"]], s["n_new"], sides,
                                        kv_pairs)
            r["mean_max_next_token_prob"] = agree.pop("mean_max_next_token_prob")
            r["greedy_agreement"] = agree
        t3 = time.perf_counter()
        r["seconds"] = {"capture": round(t1 - t0, 1), "attention": round(t2 - t1, 1),
                        "greedy": round(t3 - t2, 1)}
        results["models"][name] = r
    return results


def _table(rows: list[list[str]]) -> list[str]:
    head = "| " + " | ".join(rows[0]) + " |"
    sep = "|" + "|".join("---:" if i else "---" for i in range(len(rows[0]))) + "|"
    return [head, sep] + ["| " + " | ".join(r) + " |" for r in rows[1:]]


#: Columns of :func:`report`'s two tables per model.
SIDE_COLUMNS = ["method", "bits/elem", "K only", "V only"]
KV_COLUMNS = ["K+V", "bits/elem", "bytes/token/layer vs f16", "attention error",
              "greedy agreement", "KL vs f16 (nats)"]


def report(results: dict) -> list[str]:
    """Markdown tables of ``results`` (one pair per model: one side, then K+V)."""
    lines = []
    for name, r in results["models"].items():
        peak = r.get("mean_max_next_token_prob")
        lines += [f"### {name} (head_dim {r['head_dim']}, mean max attention prob "
                  f"{r['mean_max_attention_prob']:.3f}"
                  + (f", mean max next-token prob {peak:.3f})" if peak is not None else ")"),
                  ""]
        rows = [SIDE_COLUMNS]
        for m, bits in r["side_bits"].items():
            k, v = r["k_only"].get(m), r["v_only"].get(m)
            rows.append([m, f"{bits:.2f}", f"{k:.4f}" if k is not None else "-",
                         f"{v:.4f}" if v is not None else "-"])
        lines += _table(rows) + [""]
        rows = [KV_COLUMNS]
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
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="setting", action="store_const", const="quick",
                      help=f"small run: {SETTINGS['quick']}")
    size.add_argument("--full", dest="setting", action="store_const", const="full",
                      help=f"the published run (default): {SETTINGS['full']}")
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
    t0 = time.perf_counter()
    results = measure(names, setting=args.setting or "full", seed=args.seed,
                      attn_sharpness=args.attn_sharpness, logit_scale=args.logit_scale,
                      greedy=not args.no_greedy)
    print(f"setting {results['settings']}, {results['machine']}, "
          f"{time.perf_counter() - t0:.0f} s; per model: "
          + ", ".join(f"{n} {r['seconds']}" for n, r in results["models"].items()))
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
