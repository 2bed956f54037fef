"""Tuning sweeps for the hip/ kernels on an NVIDIA GPU: rebuild a source with other ``-D``
values, load it in place of the installed object (``Device.load_module``), time it the way
``python -m pagedkv.bench gpu`` does and check its outputs against the first variant's.

Run from the source tree, with pagedkv installed and ``nvcc`` on the PATH::

    python hip/tune.py attn --set PKV_ATTN_PARTITION_F16=512,1024 --set PKV_ATTN_MIN_BLOCKS_F16=3,4,5
    python hip/tune.py attn --kv q8s --set PKV_ATTN_Q8_STAGES=2,3 --set PKV_ATTN_PARTITION_Q8=256,512
    python hip/tune.py attn --kv q8s --variant PKV_ATTN_Q8_STAGES=2 \
        --variant PKV_ATTN_Q8_STAGE_TMA=0 --cases 32x4096,1x32768,8x32768
    python hip/tune.py attn --kv fwht4/lloyd4,fwht4/fwht4 --set PKV_ATTN_CODE_TABLE_NIBBLES=0,1
    python hip/tune.py attn --kv fwht4/fwht4,fwht2/lloyd2 --set PKV_ATTN_CODE_TABLE_PRMT=0,1
    python hip/tune.py dequant --set PKV_DEQUANT_THREADS=64,128,256
    python hip/tune.py gemv --warps 2,4,8
    python hip/tune.py gemvx --set PKV_GEMV_X_ROW_TILES=1,2 --warps auto,2,4 --batches 1,2 \
        --shapes 14336x4096,6144x4096
    python hip/tune.py gemv32 --set PKV_GEMV_PIPE_STAGES=2,3,4 --set PKV_GEMV_PIPE_TILES_PER_WARP=1,2
    python hip/tune.py gemvf16 --set PKV_GEMV_F16_X_STAGES=2,4,6 --warps 4,8 --batches 8,16,32

Each ``--set NAME=v1,v2`` multiplies the variants, each ``--variant NAME=v,NAME2=v2`` adds
one (for combinations a product cannot express); ``attn --cases`` times each variant on
several ``SEQSxTOKENS`` contexts. A variant must launch: a 1,024-token q8 partition does not
(sm_90: the staged kernel's 44.7 KB of static shared memory at 3 stages plus the 16 KB of
scores pass the 48 KB a launch gets without the opt-in attribute, which the attention
launcher does not set; H100, 2026-12-06). The knobs are the ``#ifndef`` macros of
``pkg/include/pagedkv/launch.h`` (their defaults are the figures in docs/performance.md). The
launchers' values of the swept partition size and dequant shape are set to each variant's
values. The figures of 2026-11-30 came from these sweeps on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

HIP = Path(__file__).resolve().parent
INCLUDE = HIP.parent / "pkg" / "include"


def parse_sets(items: list[str]) -> dict[str, list[str]]:
    """``["A=1,2", "B=3"]`` → ``{"A": ["1", "2"], "B": ["3"]}``."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name.isidentifier() or not values:
            raise SystemExit(f"--set {item!r}: expected NAME=v1,v2,...")
        out[name] = values.split(",")
    return out


def parse_variant(item: str) -> dict[str, str]:
    """``"A=1,B=2"`` → ``{"A": "1", "B": "2"}``: one variant, every name with one value."""
    out: dict[str, str] = {}
    for pair in item.split(","):
        name, sep, value = pair.partition("=")
        if not sep or not name.isidentifier() or not value or name in out:
            raise SystemExit(f"--variant {item!r}: expected NAME=v,NAME2=v2,...")
        out[name] = value
    return out


def variants(sets: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the ``--set`` values, in the order given."""
    names = list(sets)
    return [dict(zip(names, combo)) for combo in itertools.product(*(sets[n] for n in names))]


def nvcc_command(source: str, defines: dict[str, str], arch: str, out: Path) -> list[str]:
    return ["nvcc", "-cubin", f"-arch={arch}", "-O3", "-std=c++17", f"-I{INCLUDE}", f"-I{HIP}",
            *[f"-D{k}={v}" for k, v in defines.items()], "-x", "cu",
            str(HIP / f"{source}.hip"), "-o", str(out)]


def build(source: str, defines: dict[str, str], arch: str, tmp: Path) -> bytes:
    out = tmp / ("-".join([source, *(f"{k}{v}" for k, v in defines.items())]) + ".cubin")
    subprocess.run(nvcc_command(source, defines, arch, out), check=True)
    return out.read_bytes()


def _pct(nbytes: int, seconds: float, copy_bw: float) -> str:
    return (f"{seconds * 1e6:9.2f} us {nbytes / seconds / 1e9:8.1f} GB/s "
            f"{100 * nbytes / seconds / copy_bw:5.1f}%")


#: ``--kv`` of the attn sweep: (kv_dtype, PagedAttention switches); q8s = the staged q8 kernel.
ATTN_KINDS = {"float16": ("float16", {}), "q8": ("q8", {"q8_stage": False}),
              "q8s": ("q8", {"q8_stage": True}), "q8i": ("q8", {"q8_stage": True, "q8_int": True}),
              "q8cc": ("q8", {"q8_mma": False})}


def parse_pairs(spec: str, option: str, form: str, example: str) -> list[tuple[int, int]]:
    """``"AxB,CxD"`` → ``[(A, B), (C, D)]``, positive integers, or SystemExit naming
    ``option`` and the ``form`` it takes."""
    pairs = []
    for item in spec.split(","):
        a, sep, b = item.partition("x")
        if not (sep and a.isdigit() and b.isdigit()) or int(a) < 1 or int(b) < 1:
            raise SystemExit(f"{option} {item!r}: expected {form}, e.g. {example}")
        pairs.append((int(a), int(b)))
    return pairs


def attn_cases(spec: str, base: dict) -> list[dict]:
    """``"32x4096,1x32768"`` → the bench's attention case with those seqs and tokens."""
    return [{**base, "seqs": seqs, "tokens": tokens}
            for seqs, tokens in parse_pairs(spec, "--cases", "SEQSxTOKENS", "8x32768")]


def gemv_shapes(spec: str) -> tuple[tuple[int, int], ...]:
    """``"14336x4096,272x512"`` → GEMV ``(M, K)`` shapes (K a multiple of 256: a group)."""
    shapes = parse_pairs(spec, "--shapes", "MxK", "14336x4096")
    for M, K in shapes:
        if K % 256:
            raise SystemExit(f"--shapes {M}x{K}: K must be a multiple of 256 (one group)")
    return tuple(shapes)


def attn_kind(kind: str) -> tuple[str, dict]:
    """``--kv`` → (kv_dtype, PagedAttention switches): one of :data:`ATTN_KINDS` or a
    compressed ``<K>/<V>`` pair (its default kernels: ``_mma`` where the pair has them)."""
    from pagedkv.kernels import kvcache
    if kind in ATTN_KINDS:
        return ATTN_KINDS[kind]
    if kind in kvcache.QUANT_KV_DTYPES:
        return kind, {}
    raise SystemExit(f"--kv {kind!r}: expected one of {sorted(ATTN_KINDS)} or a compressed "
                     f"pair such as fwht4/lloyd4")


def attn_base_case(B, kind: str, head_dim: int | None) -> dict:
    """The bench's attention case for ``--kv``: head_dim 256 (4 KV heads) where asked or where
    a side is a lloyd or 3-bit mode (their codebooks are the R256 family's), else 128."""
    if head_dim is None:
        head_dim = 256 if ("lloyd" in kind or "fwht3" in kind) else 128
    return B.ATTENTION_CASE_256 if head_dim == 256 else B.ATTENTION_CASE


def sweep_attn(dev, stream, copy_bw, B, images, case=None, kind="float16") -> None:
    from pagedkv.kernels import kvcache
    from pagedkv.kernels.launch_constants import launch_constant
    case = case or B.ATTENTION_CASE
    kv_dtype, switches = attn_kind(kind)
    suffix = "QKV" if kv_dtype in kvcache.QUANT_KV_DTYPES else kvcache.KV_SUFFIX[kv_dtype]
    args, nbytes, attn_kwargs = B.attention_inputs(dev, np.random.default_rng(0), kv_dtype,
                                                   **case)
    out = args[-1]
    first = None
    for defines, image in images:
        dev.load_module("kvcache", image)
        kvcache.ATTN_PARTITION_TOKENS[kv_dtype] = int(defines.get(
            f"PKV_ATTN_PARTITION_{suffix}", launch_constant(f"PKV_ATTN_PARTITION_{suffix}")))
        kvcache.ATTN_PARTITION_TOKENS_QKV_MMA = int(defines.get(  # the NVIDIA _mma kernels'
            "PKV_ATTN_PARTITION_QKV_MMA", launch_constant("PKV_ATTN_PARTITION_QKV_MMA")))
        t = B.time_attention(dev, stream, kvcache.PagedAttention(dev, **attn_kwargs, **switches),
                             args)
        got = out.to_numpy()
        first = got if first is None else first
        context = f"{case['seqs']}x{case['tokens']}"
        print(f"attn {kind} {context} {defines}: {_pct(nbytes, t, copy_bw)} "
              f"max|diff| vs first {np.max(np.abs(got - first)):.2e}", flush=True)


def _load_weights_variant(dev, defines: dict[str, str], image: bytes, names) -> None:
    """Serve weights.hip from ``image`` and set the launcher's mirrors ``weights.<NAME>`` of
    its swept ``PKV_<NAME>`` values (the header's default where the variant leaves one)."""
    from pagedkv.kernels import weights
    from pagedkv.kernels.launch_constants import launch_constant
    dev.load_module("weights", image)
    for name in names:
        setattr(weights, name, int(defines.get(f"PKV_{name}", launch_constant(f"PKV_{name}"))))


def sweep_dequant(dev, stream, copy_bw, B, images, shape=(14336, 4096)) -> None:
    from pagedkv import quant
    from pagedkv.kernels import weights
    rng = np.random.default_rng(1)
    M, K = shape
    raws = {fmt: quant.quantize((rng.standard_normal((M, K)) * 0.02).astype(np.float32), fmt)
            for fmt in ("hfq4g256", "mq4g256v2", "hfq6g256", "q8f16")}
    first: dict = {}
    for defines, image in images:
        _load_weights_variant(dev, defines, image, ("DEQUANT_SPAN", "DEQUANT_THREADS"))
        for fmt, raw in raws.items():
            dr = dev.array(raw)
            for dt in (np.float16, np.float32):
                o = dev.empty((M, K), dt)
                t = B._time_graph(dev, stream, partial(B._repeat, weights.dequantize,
                                                       (dev, dr, fmt, o), 10), 10)
                got = o.to_numpy().tobytes()
                same = first.setdefault((fmt, dt), got) == got
                print(f"dequant {fmt}->{np.dtype(dt).name} {defines}: "
                      f"{_pct(raw.nbytes + o.nbytes, t, copy_bw)} same bytes as first: {same}",
                      flush=True)
                o.free()
            dr.free()


def sweep_gemv(dev, stream, copy_bw, B, warps: list[int],
               shapes=((4096, 4096), (4096, 14336), (14336, 4096))) -> None:
    from pagedkv import quant
    from pagedkv.kernels import weights
    rng = np.random.default_rng(2)
    for M, K in shapes:
        for fmt in ("mq4g256v2", "hfq4g256"):
            raw = quant.quantize((rng.standard_normal((M, K)) * 0.02).astype(np.float32), fmt)
            dev_w, calls = B.rotating_weights(dev, fmt, M, K, raw)
            x = dev.array(rng.standard_normal((1, K)).astype(np.float32))
            y = dev.empty((1, M), np.float32)
            for w in warps:
                g = weights.Gemv(dev, fmt, M, K, warps=w)
                g.prepare(x, stream=stream)
                t = B._time_graph(dev, stream, partial(B._rotating, g.run_prepared, dev_w,
                                                       (y,), calls), calls)
                print(f"gemv {fmt} b1 {M}x{K} warps={w} (x prepared): "
                      f"{_pct(raw.nbytes + 4 * (K + M), t, copy_bw)}", flush=True)
            for d in dev_w:
                d.free()


def sweep_gemv32(dev, stream, copy_bw, B, images, batch=32,
                 shapes=((4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096))) -> None:
    """The pipelined batch 9-32 GEMV (gemv_mma_pipe) per variant of its launch.h knobs, x
    prepared once; the outputs of every variant must be the first's, byte for byte (the
    stages and tiles per warp change no f32 operation, only who computes it when)."""
    from pagedkv import quant
    from pagedkv.errors import InvalidArgument
    from pagedkv.kernels import weights
    rng = np.random.default_rng(3)
    cases = []
    for M, K in shapes:
        for fmt in ("mq4g256v2", "hfq4g256"):
            raw = quant.quantize((rng.standard_normal((M, K)) * 0.02).astype(np.float32), fmt)
            x = dev.array(rng.standard_normal((batch, K)).astype(np.float32))
            cases.append((fmt, M, K, raw, x))
    first: dict = {}
    for defines, image in images:
        _load_weights_variant(dev, defines, image, ("GEMV_PIPE_STAGES", "GEMV_PIPE_TILES_PER_WARP"))
        for fmt, M, K, raw, x in cases:
            try:
                g = weights.Gemv(dev, fmt, M, K, batch, pipe=True)
            except InvalidArgument as e:  # a variant whose ring does not fit: say so, go on
                print(f"gemv32 {fmt} {M}x{K} {defines}: {e}", flush=True)
                continue
            dev_w, calls = B.rotating_weights(dev, fmt, M, K, raw)
            y = dev.empty((batch, M), np.float32)
            g.prepare(x, stream=stream)
            t = B._time_graph(dev, stream, partial(B._rotating, g.run_prepared, dev_w, (y,),
                                                   calls), calls)
            got = y.to_numpy().tobytes()
            same = first.setdefault((fmt, M, K), got) == got
            print(f"gemv32 {fmt} b{batch} {M}x{K} {defines} grid {g._grid}: "
                  f"{_pct(raw.nbytes, t, copy_bw)} same bytes as first: {same}", flush=True)
            for d in dev_w:
                d.free()


def gemv_cases(dev, B, shapes, formats, batches, seed: int):
    """``(fmt, M, K, raw, dev_w, calls, batch, x, y)`` per shape, format and batch of a GEMV
    sweep: Gaussian weights uploaded as the bench rotates them (``dev_w``, ``calls`` per
    graph), a random x and a y; the weights are freed after their shape's last batch."""
    from pagedkv import quant
    rng = np.random.default_rng(seed)
    for M, K in shapes:
        for fmt in formats:
            raw = quant.quantize((rng.standard_normal((M, K)) * 0.02).astype(np.float32), fmt)
            dev_w, calls = B.rotating_weights(dev, fmt, M, K, raw)
            for batch in batches:
                x = dev.array(rng.standard_normal((batch, K)).astype(np.float32))
                y = dev.empty((batch, M), np.float32)
                yield fmt, M, K, raw, dev_w, calls, batch, x, y
            for d in dev_w:
                d.free()


X_KNOBS = ("GEMV_X_ROW_TILES", "GEMV_X_ROW_TILES_WIDE")  # the fused-x kernel's mirrors


#: gemvx's --shapes default (272 rows: 17 tiles, a last block of one at 2 tiles a block)
GEMVX_SHAPES = "4096x4096,4096x14336,14336x4096,272x512"


def sweep_gemvx(dev, stream, copy_bw, B, images, warps: list[int | None], batches: list[int],
                formats: tuple[str, ...], shapes: tuple[tuple[int, int], ...]) -> None:
    """The fused-x GEMV (pkv_gemv_mma_x_*, batch 1-2) per variant of its launch.h knobs
    (16-row tiles per block) and warps per block (None: the launcher's choice), against the
    two launches (prep + GEMV, which no knob here changes), the GEMV alone on x prepared
    beforehand (what the fused launch could at best reach) and PyTorch's tinygemm int4 in
    the same run. Every launch must give the bytes of the two launches with as many warps (the
    warps' partial sums meet in a fixed order, so another warp count rounds differently; 272
    rows: 17 tiles, so a block of two tiles per block holds one in the last)."""
    from pagedkv.kernels import weights
    torch = B._torch()
    # gemv_cases builds a Gemv (rotating_weights) before the loop body: a build without
    # kernel objects (device_check.sh OBJECTS=0) has no weights module until one is loaded
    _load_weights_variant(dev, images[0][0], images[0][1], X_KNOBS)
    for fmt, M, K, _, dev_w, calls, batch, x, y in gemv_cases(dev, B, shapes, formats, batches, 4):
        def output(g, x=x, y=y, dev_w=dev_w):
            g.run(dev_w[0], x, y, stream=stream)
            stream.synchronize()
            return y.to_numpy().tobytes()

        def timed(g, x=x, y=y, dev_w=dev_w, calls=calls):
            t = B._time_graph(dev, stream, partial(B._rotating, g.run, dev_w, (x, y), calls),
                              calls)
            return t, output(g)
        _load_weights_variant(dev, images[0][0], images[0][1], X_KNOBS)
        two = weights.Gemv(dev, fmt, M, K, batch, fused_x=False)
        t_two, _ = timed(two)
        two.prepare(x, stream=stream)  # the GEMV alone on x prepared once: the floor
        t_alone = B._time_graph(dev, stream, partial(B._rotating, two.run_prepared, dev_w,
                                                     (y,), calls), calls)
        want: dict[int, bytes] = {}  # the two launches' output per warps per block
        t_tg = B.tinygemm_time(torch, M, K, batch) if torch is not None else None
        peer = f"; tinygemm {t_tg * 1e6:.2f} us" if t_tg else ""
        print(f"gemvx {fmt} b{batch} {M}x{K} two launches: {t_two * 1e6:.2f} us; the GEMV "
              f"alone on x prepared: {t_alone * 1e6:.2f} us{peer}", flush=True)
        for defines, image in images:
            _load_weights_variant(dev, defines, image, X_KNOBS)
            for w in warps:
                g = weights.Gemv(dev, fmt, M, K, batch, fused_x=True, warps=w)
                t, got = timed(g)
                n_warps = g._fused_block[0] // dev.properties.warp_size
                if n_warps not in want:
                    want[n_warps] = output(weights.Gemv(dev, fmt, M, K, batch, fused_x=False,
                                                        warps=n_warps))
                vs = f", {t_tg / t:.2f}x tinygemm" if t_tg else ""
                print(f"gemvx {fmt} b{batch} {M}x{K} {defines} {g.fused_launch}: "
                      f"{t * 1e6:.2f} us, {t / t_two:.3f}x the two launches' time{vs}; "
                      f"same bytes as the two launches at {n_warps} warps: "
                      f"{got == want[n_warps]}", flush=True)


F16_KNOBS = ("GEMV_F16_X_STAGES",)  # launcher mirrors of gemv_f16's launch.h values


def sweep_gemvf16(dev, stream, copy_bw, B, images, warps: list[int], batches: list[int],
                  tiles: tuple[int, ...] = (1, 2), splits: tuple[int | None, ...] = (None,),
                  formats: tuple[str, ...] = ("mq4g256v2", "hfq4g256"),
                  shapes=((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336))) -> None:
    """The f16-activation GEMV (gemv_f16) per variant of its launch.h knobs, per 16-row tiles
    per warp (1, 2), warps per block and group splits (None: the launcher's choice), x
    prepared once, against the exact int8 kernel of the same batch in the same run. The
    ring depth and the registers change no f32 operation: each (tiles, warps, splits)
    configuration must give the first variant's bytes."""
    from pagedkv.kernels import weights
    first: dict = {}
    default_tpw, default_splits = weights.GEMV_F16_TILES_PER_WARP, weights.GEMV_F16_MAX_SPLITS
    _load_weights_variant(dev, images[0][0], images[0][1], F16_KNOBS)  # as sweep_gemvx
    for fmt, M, K, raw, dev_w, calls, batch, x, y in gemv_cases(dev, B, shapes, formats,
                                                                batches, 3):
        def timed(g, x=x, y=y, dev_w=dev_w, calls=calls):
            g.prepare(x, stream=stream)
            return B._time_graph(dev, stream, partial(B._rotating, g.run_prepared, dev_w,
                                                      (y,), calls), calls)
        _load_weights_variant(dev, images[0][0], images[0][1], F16_KNOBS)
        t_int8 = timed(weights.Gemv(dev, fmt, M, K, batch, f16_x=False))
        for defines, image in images:
            _load_weights_variant(dev, defines, image, F16_KNOBS)
            for tpw in tiles:
                weights.GEMV_F16_TILES_PER_WARP = tpw
                for w, split in itertools.product(warps, splits):
                    if split and split > K // 256:
                        continue
                    # an explicit split may exceed the launcher's most; "auto" keeps it
                    weights.GEMV_F16_MAX_SPLITS = max(default_splits, split or 0)
                    g = weights.Gemv(dev, fmt, M, K, batch, f16_x=True, warps=w,
                                     splits=split)
                    t = timed(g)
                    got = y.to_numpy().tobytes()
                    key = (fmt, M, K, batch, tpw, w, g._grid[1])
                    same = first.setdefault(key, got) == got
                    print(f"gemvf16 {fmt} b{batch} {M}x{K} {defines} tiles/warp {tpw} "
                          f"warps {w} grid {g._grid}: {_pct(raw.nbytes, t, copy_bw)}, "
                          f"{t_int8 / t:.2f}x the int8 kernel; same bytes as first: "
                          f"{same}", flush=True)
        weights.GEMV_F16_TILES_PER_WARP = default_tpw
    weights.GEMV_F16_MAX_SPLITS = default_splits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python hip/tune.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("attn", "dequant", "gemv", "gemv32", "gemvf16", "gemvx"))
    p.add_argument("--set", action="append", default=[], metavar="NAME=v1,v2",
                   help="a -D macro and the values to try (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=v,NAME2=v2",
                   help="one more variant with exactly these -D values (repeatable; after "
                        "the --set product), for combinations a product cannot express")
    p.add_argument("--warps", default=None,
                   help="gemv, gemvf16 (default 2,4,8), gemvx (default auto: the launcher's "
                        "choice): warps per block to try")
    p.add_argument("--batches", default=None,
                   help="gemvf16 (default 8,16,32), gemvx (default 1,2): batch rows to try")
    p.add_argument("--tiles", default="1,2", help="gemvf16: 16-row tiles per warp to try")
    p.add_argument("--splits", default="auto",
                   help="gemvf16: group splits to try (auto: the launcher's choice)")
    p.add_argument("--formats", default="mq4g256v2,hfq4g256",
                   help="gemvf16, gemvx: weight formats")
    p.add_argument("--shapes", default=None,
                   help="gemvx, gemvf16: MxK weight shapes, comma-separated (K a multiple of "
                        f"256; gemvx's default {GEMVX_SHAPES}, gemvf16's its own four)")
    p.add_argument("--kv", default="float16",
                   help=f"attn: the KV kinds timed, comma-separated: {sorted(ATTN_KINDS)} (q8s: "
                        "the staged q8 kernel) or compressed pairs such as fwht4/lloyd4")
    p.add_argument("--head-dim", type=int, choices=(128, 256), default=None,
                   help="attn: the case's head_dim (256: 4 KV heads of 16 q heads); by default "
                        "256 for lloyd and 3-bit pairs, else 128")
    p.add_argument("--cases", default="32x4096",
                   help="attn: SEQSxTOKENS contexts to time, comma-separated (the bench's "
                        "32 q / 8 KV heads of 128; e.g. 32x4096,1x32768,8x32768)")
    args = p.parse_args(argv)
    if args.what == "attn":  # a wrong --kv fails now, not after minutes of nvcc
        for kind in args.kv.split(","):
            attn_kind(kind)
    if args.shapes is not None and args.what not in ("gemvx", "gemvf16"):
        raise SystemExit(f"--shapes: only gemvx and gemvf16 take weight shapes, not {args.what}")
    # likewise a wrong --shapes
    shapes = gemv_shapes(args.shapes or GEMVX_SHAPES) if args.what == "gemvx" else None
    f16_shapes = {} if args.shapes is None else {"shapes": gemv_shapes(args.shapes)}
    from pagedkv.bench import gpu as B
    from pagedkv.kernels import Stream
    dev = B.open_device_or_explain("hip/tune.py")
    if dev is None:
        return 1
    if dev.backend != "cuda":
        print("hip/tune.py: rebuilds with nvcc, so it needs an NVIDIA device", file=sys.stderr)
        return 1
    stream = Stream(dev)
    copy_bw, _ = B.copy_bandwidth(dev, stream)
    print(f"{dev!r}; copy bandwidth {copy_bw / 1e9:.1f} GB/s", flush=True)
    warps = args.warps or ("auto" if args.what == "gemvx" else "2,4,8")
    warps_list = [None if w == "auto" else int(w) for w in warps.split(",")]
    batches = [int(b) for b in (args.batches or ("1,2" if args.what == "gemvx"
                                                 else "8,16,32")).split(",")]
    if args.what == "gemv":
        sweep_gemv(dev, stream, copy_bw, B, warps_list)
        return 0
    source = "kvcache" if args.what == "attn" else "weights"  # the GEMV sweeps, dequant
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor() as pool:
        # one nvcc per variant at once: a variant's build is single-threaded
        todo = variants(parse_sets(args.set)) if args.set or not args.variant else []
        todo += [parse_variant(v) for v in args.variant]
        images = list(zip(todo, pool.map(
            lambda d: build(source, d, dev.properties.arch, Path(tmp)), todo)))
    if args.what == "attn":
        for kind in args.kv.split(","):  # every variant built once, timed on each kind
            for case in attn_cases(args.cases, attn_base_case(B, kind, args.head_dim)):
                sweep_attn(dev, stream, copy_bw, B, images, case, kind=kind)
    elif args.what == "gemv32":
        sweep_gemv32(dev, stream, copy_bw, B, images)
    elif args.what == "gemvx":
        sweep_gemvx(dev, stream, copy_bw, B, images, warps_list, batches,
                    tuple(args.formats.split(",")), shapes)
    elif args.what == "gemvf16":
        sweep_gemvf16(dev, stream, copy_bw, B, images, warps_list, batches,
                      tuple(int(t) for t in args.tiles.split(",")),
                      tuple(None if v == "auto" else int(v) for v in args.splits.split(",")),
                      tuple(args.formats.split(",")), **f16_shapes)
    else:
        sweep_dequant(dev, stream, copy_bw, B, images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
