"""One decode step of a Llama-shaped decoder on the GPU, with pagedkv's kernels only.

Per layer: RMSNorm (fused with the residual add) → the packed QKV projection through the
4-bit GEMV → RoPE (splitting q, k, v) → this step's K/V written into the device pool at the
adapter's slot mapping (f16, bf16 or q8) → paged attention over the adapter's block tables
→ O projection → residual + RMSNorm → the packed gate/up projection → SiLU(gate)·up → down
projection; then the final norm and the LM head. No PyTorch. It exists to measure what the
kernels and the glue cost in a real step (``python -m pagedkv.bench decode``) and to prove
them correct together against :mod:`pagedkv.kernels.numpy_decoder`; it is not a model
runtime (no embedding lookup, no sampling: the step starts from hidden states and ends at
logits).

Weights: :class:`DecoderHostWeights` holds each layer's stored bytes (``qkv`` =
``[Wq; Wk; Wv]`` and ``gate_up`` = ``[Wgate; Wup]`` packed by rows, the split given by the
shape) and float32 norm weights; :class:`DecoderWeights` is the same on the device, in the
layout the GEMV reads. A projection runs as GEMV calls of at most ``gemv_rows`` batch rows:
by default the most one call takes (32 on the tensor-core kernel, whose tiled variant reads
each weight tile once for all of them; 8 on the CUDA-core kernel); ``gemv_rows=8`` (or the
environment variable ``PAGEDKV_DECODE_GEMV_ROWS=8``) keeps the earlier path of 8-row
calls, each re-reading the weights.

Fused nodes (``fuse=True``, the default; ``fuse=False`` or ``PAGEDKV_DECODE_FUSE=0`` runs
the unfused launches, for comparison): where a projection is one tensor-core GEMV call,
the RMSNorm before QKV, gate/up and the LM head and the SiLU·up before down write that
GEMV's prepared x themselves (``decode.add_rmsnorm_prep``, ``decode.silu_mul_prep``), and
RoPE writes this token's K and V straight into f16, bf16 and q8 pools
(``paged.qkv_rope_write_kv``), and attention's partition reduce writes the O projection's
prepared x (``paged.attention_prep``; f16, bf16 and q8 pools, not the KV-mode pairs whose
reduce rotates V back): per layer 5 launches fewer (q8: 6), the same bytes. In the fused
step :attr:`DecoderStep.k`, ``v`` and the attention output are not written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.env_knobs import env_bool, env_u32
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.kernels.decode import (
    _check_norm,
    add_rmsnorm,
    add_rmsnorm_prep,
    qkv_rope_split,
    silu_mul,
    silu_mul_prep,
)
from pagedkv.kernels.device import Device, StreamLike
from pagedkv.kernels.device_array import DeviceArray, need_array
from pagedkv.kernels.kvcache import PagedAttention, attention_group_slots
from pagedkv.kernels.paged import (
    DeviceDecodeBatch,
    check_attention,
    qkv_rope_write_kv,
    rope_write_fusable,
    write_kv,
)
from pagedkv.kernels.weights import Gemv, GemvWeights, PreparedX, max_batch

__all__ = [
    "LLAMA3_8B",
    "MATRICES",
    "DecoderHostWeights",
    "DecoderShape",
    "DecoderStep",
    "DecoderWeights",
]

#: The head dims :class:`DecoderShape` takes: those of the paged attention kernels.
_HEAD_DIMS = (32, 64, 128, 256)
#: The per-layer projection matrices, in step order.
MATRICES = ("qkv", "o", "gate_up", "down")
#: Environment variable: batch rows per GEMV call of a DecoderStep (8 = the 8-row path).
GEMV_ROWS_ENV = "PAGEDKV_DECODE_GEMV_ROWS"
#: Environment variable: 0 runs a DecoderStep's unfused launches (the default fuses).
FUSE_ENV = "PAGEDKV_DECODE_FUSE"
#: Environment variable: 1 also fuses attention's reduce with the O projection's x prep
#: (``attn+prep:o``); opt-in: correct on the H200 but no faster there (docs/performance.md).
FUSE_ATTN_PREP_ENV = "PAGEDKV_DECODE_FUSE_ATTN_PREP"


@dataclass(frozen=True)
class DecoderShape:
    """A Llama-style decoder: ``num_layers`` of ``d_model`` with ``q_heads`` / ``kv_heads``
    attention heads of ``head_dim`` and a SwiGLU FFN of ``ffn``; ``vocab`` rows of LM head;
    RoPE base ``rope_theta`` (no frequency scaling); RMSNorm ``eps``.

    Checked when built (``InvalidArgumentType`` for a value of the wrong type,
    ``InvalidArgument`` otherwise, each naming the field): the sizes are ints >= 1 (bools
    and floats refused; NumPy integers stored as ``int``); ``head_dim`` is 32, 64, 128 or
    256 (the paged attention kernels; RoPE also needs it even); ``q_heads`` a multiple of
    ``kv_heads``, 1 to 8 query heads per KV head (at most 4 at ``head_dim`` 32: a token's
    ``head_dim / 8`` lanes carry the group's scores); ``q_heads * head_dim == d_model``;
    ``ffn`` a multiple of 32 (the down projection's K: every GEMV format needs K a multiple
    of 32, all but ``q8f16`` of 256, which :class:`~pagedkv.kernels.weights.Gemv` checks
    per format); ``rope_theta`` and ``eps`` finite and > 0."""

    num_layers: int = 32
    d_model: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 32768
    rope_theta: float = 500000.0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "q_heads", "kv_heads", "head_dim", "ffn",
                     "vocab"):
            object.__setattr__(self, name,
                               int_argument(f"DecoderShape.{name}", getattr(self, name), 1))
        for name in ("rope_theta", "eps"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, (int, float, np.integer, np.floating)):
                raise InvalidArgumentType(f"DecoderShape.{name} must be a real number, got "
                                          f"{type(value).__name__}")
            if not math.isfinite(value) or value <= 0:
                raise InvalidArgument(f"DecoderShape.{name} = {value!r} must be finite and > 0")
            object.__setattr__(self, name, float(value))
        hd, q, kv = self.head_dim, self.q_heads, self.kv_heads
        if hd not in _HEAD_DIMS:
            raise InvalidArgument(f"DecoderShape.head_dim = {hd}: the paged attention kernels "
                                  f"take {' / '.join(map(str, _HEAD_DIMS))} (RoPE also needs "
                                  f"an even head_dim)")
        if q % kv or q // kv > 8:
            raise InvalidArgument(f"DecoderShape.q_heads = {q}: must be 1 to 8 times kv_heads "
                                  f"= {kv} (GQA groups of 1..8 query heads per KV head)")
        if attention_group_slots(q, kv) > hd // 8:
            raise InvalidArgument(f"DecoderShape.q_heads = {q}: {q // kv} query heads per KV "
                                  f"head, at most {hd // 8} at head_dim {hd} (a token's "
                                  f"head_dim / 8 lanes carry the group's scores)")
        if q * hd != self.d_model:
            raise InvalidArgument(f"DecoderShape.d_model = {self.d_model}: q_heads * head_dim "
                                  f"must equal d_model ({q} * {hd} = {q * hd})")
        if self.ffn % 32:
            raise InvalidArgument(f"DecoderShape.ffn = {self.ffn}: must be a multiple of 32 "
                                  f"(the down projection's K; every GEMV format takes K a "
                                  f"multiple of 32, all but q8f16 of 256)")

    def matrix_shape(self, name: str) -> tuple[int, int]:
        """``(M, K)`` of a projection (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``)."""
        d, hd = self.d_model, self.head_dim
        shapes = {"qkv": ((self.q_heads + 2 * self.kv_heads) * hd, d), "o": (d, d),
                  "gate_up": (2 * self.ffn, d), "down": (d, self.ffn),
                  "lm_head": (self.vocab, d)}
        return shapes[name]

    def weight_count(self) -> int:
        """Projection weights of a step (every layer, the LM head)."""
        per_layer = sum(math.prod(self.matrix_shape(m)) for m in MATRICES)
        return self.num_layers * per_layer + math.prod(self.matrix_shape("lm_head"))


#: Llama-3-8B's shape with the vocabulary reduced from 128,256 to 32,768 (the LM head is
#: one GEMV; its size changes the step by a fixed amount, stated with the figures).
LLAMA3_8B = DecoderShape()


@dataclass
class DecoderHostWeights:
    """Stored weight bytes per layer and matrix (``layers[i][name]``, ``uint8``), the LM
    head's, and float32 norm weights (``attn_norm[i]``, ``ffn_norm[i]``, ``final_norm``)."""

    shape: DecoderShape
    fmt: str
    layers: list[dict[str, np.ndarray]]
    lm_head: np.ndarray
    attn_norm: list[np.ndarray]
    ffn_norm: list[np.ndarray]
    final_norm: np.ndarray

    @classmethod
    def random(cls, shape: DecoderShape, fmt: str, seed: int) -> DecoderHostWeights:
        """Weights uniform with variance ``1/K`` quantized to ``fmt`` (activations stay O(1)
        through the layers), norm weights ``1 + N(0, 0.1)``: for correctness checks."""
        from pagedkv import quant
        rng = np.random.default_rng(seed)

        def matrix(name):
            m, k = shape.matrix_shape(name)
            # uniform, not normal: several times faster to draw at Llama widths
            w = rng.random((m, k), dtype=np.float32)
            w -= np.float32(0.5)
            w *= np.float32(math.sqrt(12 / k))
            return quant.quantize(w, fmt)

        def norm():
            return (1 + 0.1 * rng.standard_normal(shape.d_model)).astype(np.float32)

        layers = [{m: matrix(m) for m in MATRICES} for _ in range(shape.num_layers)]
        return cls(shape, fmt, layers, matrix("lm_head"),
                   [norm() for _ in range(shape.num_layers)],
                   [norm() for _ in range(shape.num_layers)], norm())

    @classmethod
    def tiled(cls, shape: DecoderShape, fmt: str, seed: int,
              rows: int = 64) -> DecoderHostWeights:
        """Fast weights for timing: ``rows`` random rows quantized once per matrix and
        repeated down to ``M`` (valid groups, every byte read like any other weight); the
        same bytes for every layer (the device copies are distinct allocations)."""
        from pagedkv import quant
        rng = np.random.default_rng(seed)

        def matrix(name):
            m, k = shape.matrix_shape(name)
            r = min(rows, m)
            w = rng.standard_normal((r, k), dtype=np.float32) / np.float32(math.sqrt(k))
            raw = quant.quantize(w, fmt).reshape(r, -1)
            return np.tile(raw, (-(-m // r), 1))[:m].reshape(-1)

        layer = {m: matrix(m) for m in MATRICES}
        ones = np.ones(shape.d_model, np.float32)
        return cls(shape, fmt, [layer] * shape.num_layers, matrix("lm_head"),
                   [ones] * shape.num_layers, [ones] * shape.num_layers, ones)

    def weight_bytes(self) -> int:
        """Stored bytes of every projection of a step."""
        return sum(raw.nbytes for layer in self.layers for raw in layer.values()) + \
            self.lm_head.nbytes


def _check_host(host: DecoderHostWeights) -> None:
    """``InvalidArgument`` naming the first part of ``host`` that does not fit its shape and
    format (layer count, a missing matrix, a byte count, a norm weight), before anything is
    uploaded."""
    from pagedkv.kernels.weights import _format, raw_nbytes
    if not isinstance(host, DecoderHostWeights):
        raise InvalidArgumentType(f"host: expected a DecoderHostWeights, got "
                                  f"{type(host).__name__}")
    _format(host.fmt)  # a format with a GEMV (InvalidArgument listing them otherwise)
    s = host.shape
    for name, per_layer in (("layers", host.layers), ("attn_norm", host.attn_norm),
                            ("ffn_norm", host.ffn_norm)):
        if len(per_layer) != s.num_layers:
            raise InvalidArgument(f"host.{name}: {len(per_layer)} layers, the shape has "
                                  f"{s.num_layers}")

    def check_raw(where: str, raw, matrix: str) -> None:
        m, k = s.matrix_shape(matrix)
        want = raw_nbytes(host.fmt, m * k)
        if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.size != want:
            got = (f"{raw.dtype}[{raw.size}]" if isinstance(raw, np.ndarray)
                   else type(raw).__name__)
            raise InvalidArgument(f"host.{where}: {got}, expected uint8[{want}]: {host.fmt} of "
                                  f"{m}x{k} ({_MATRIX_ROWS[matrix]})")

    for i, layer in enumerate(host.layers):
        missing = [m for m in MATRICES if m not in layer]
        if missing:
            raise InvalidArgument(f"host.layers[{i}]: no {missing}; a layer holds {list(MATRICES)}")
        for m in MATRICES:
            check_raw(f"layers[{i}][{m!r}]", layer[m], m)
    check_raw("lm_head", host.lm_head, "lm_head")
    norms = [(f"attn_norm[{i}]", w) for i, w in enumerate(host.attn_norm)]
    norms += [(f"ffn_norm[{i}]", w) for i, w in enumerate(host.ffn_norm)]
    for where, w in (*norms, ("final_norm", host.final_norm)):
        if (not isinstance(w, np.ndarray) or w.dtype != np.float32
                or w.shape != (s.d_model,)):
            got = f"{w.dtype}{list(w.shape)}" if isinstance(w, np.ndarray) else type(w).__name__
            raise InvalidArgument(f"host.{where}: {got}, expected float32[{s.d_model}]")


#: What each projection's rows are, for the errors of :func:`_check_host`.
_MATRIX_ROWS = {"qkv": "rows [Wq; Wk; Wv]: (q_heads + 2 kv_heads) x head_dim",
                "o": "d_model rows", "gate_up": "rows [Wgate; Wup]: 2 x ffn",
                "down": "d_model rows of ffn", "lm_head": "vocab rows"}


class DecoderWeights:
    """:class:`DecoderHostWeights` on the device in the GEMV's layout. Identical host
    arrays (``tiled``) are packed and uploaded once, then copied on the device. The host
    weights are checked against their shape and format first (``InvalidArgument`` naming
    the layer and matrix or norm; nothing uploaded)."""

    def __init__(self, device: Device, host: DecoderHostWeights) -> None:
        _check_host(host)
        self.device, self.shape, self.fmt = device, host.shape, host.fmt
        uploaded: dict[int, GemvWeights] = {}

        def up(name: str, raw: np.ndarray) -> GemvWeights:
            m, k = self.shape.matrix_shape(name)
            first = uploaded.get(id(raw))
            if first is None:
                first = uploaded[id(raw)] = Gemv(device, self.fmt, m, k).upload(raw)
                return first
            copy = device.empty(first.array.shape, np.uint8)
            device.copy_dtod(copy.ptr, first.array.ptr, first.array.nbytes)
            return GemvWeights(copy, first.fmt, first.M, first.K, first.packed)

        self.layers = [{m: up(m, layer[m]) for m in MATRICES} for layer in host.layers]
        self.lm_head = up("lm_head", host.lm_head)
        self.attn_norm = [device.array(w) for w in host.attn_norm]
        self.ffn_norm = [device.array(w) for w in host.ffn_norm]
        self.final_norm = device.array(host.final_norm)
        device.synchronize()

    def __repr__(self) -> str:
        return (f"DecoderWeights({self.shape}, fmt={self.fmt!r}, {self.nbytes} projection "
                f"bytes on {self.device.properties.name!r})")

    @property
    def nbytes(self) -> int:
        """Device bytes of the projections the step reads."""
        return sum(w.array.nbytes for layer in self.layers for w in layer.values()) + \
            self.lm_head.array.nbytes

    def free(self) -> None:
        for layer in self.layers:
            for w in layer.values():
                w.free()
        self.lm_head.free()


class _Projection:
    """One weight shape's GEMVs over batch chunks of at most ``rows`` rows."""

    def __init__(self, device: Device, fmt: str, m: int, k: int, batch: int,
                 rows: int) -> None:
        self.chunks = [(lo, min(batch, lo + rows)) for lo in range(0, batch, rows)]
        self.gemvs = {n: Gemv(device, fmt, m, k, n) for n in {hi - lo for lo, hi in self.chunks}}

    def check(self, w: GemvWeights, y: DeviceArray) -> None:
        """Each chunk's GEMV checks of ``w`` and ``y`` (:meth:`Gemv.run_prepared`'s), no
        launch."""
        for lo, hi in self.chunks:
            self.gemvs[hi - lo]._check_wy(w, y.rows(lo, hi))

    def __call__(self, w: GemvWeights, x: DeviceArray, y: DeviceArray, stream) -> None:
        for lo, hi in self.chunks:
            self.gemvs[hi - lo].run(w, x.rows(lo, hi), y.rows(lo, hi), stream=stream)

    def prepared_x(self) -> PreparedX | None:
        """Where a fused kernel writes this projection's prepared x: one call on the
        tensor-core kernel only (``None`` otherwise: run it with :meth:`__call__`)."""
        gemv = next(iter(self.gemvs.values()))
        if len(self.chunks) != 1 or not gemv.tensor_cores:
            return None
        return gemv.prepared_x()

    def run_prepared(self, w: GemvWeights, y: DeviceArray, stream) -> None:
        next(iter(self.gemvs.values())).run_prepared(w, y, stream=stream)


class DecoderStep:
    """The launches of one decode step for ``batch`` sequences over ``pool`` (a device
    ``LayerKVPool`` with the shape's KV geometry). Put the input hidden states in
    :attr:`x` (``float32[batch, d_model]``); :meth:`run` leaves the logits in
    :attr:`logits` (``float32[batch, vocab]``) and the residual stream in :attr:`x`.
    Buffers are allocated once, so a step can be captured in a graph and replayed.

    ``gemv_rows``: batch rows per GEMV call (1 up to :func:`~pagedkv.kernels.weights.max_batch`;
    ``None``: ``PAGEDKV_DECODE_GEMV_ROWS`` when set, else that maximum). 8 selects the
    8-row path of the batch 1-8 tensor-core kernel, the tiled kernel's fallback.
    ``fuse``: the fused launches (module docstring; ``None``: ``PAGEDKV_DECODE_FUSE``,
    default on); :attr:`fused` lists the fusions this step runs."""

    def __init__(self, device: Device, weights: DecoderWeights, pool, batch: int,
                 max_seq_len: int, *, gemv_rows: int | None = None,
                 fuse: bool | None = None) -> None:
        s = weights.shape
        most = max_batch(device, weights.fmt)
        if gemv_rows is None:
            gemv_rows = min(env_u32(GEMV_ROWS_ENV, most, fallback_source=f"max {most}"),
                            most) or most
        if not 1 <= gemv_rows <= most:
            raise InvalidArgument(f"gemv_rows={gemv_rows}: expected 1..{most} for "
                                  f"{weights.fmt} on this device")
        self.gemv_rows = gemv_rows
        g = pool.geometry
        if (g.num_layers, g.num_kv_heads, g.head_dim) != (s.num_layers, s.kv_heads, s.head_dim):
            raise InvalidArgument(f"pool: {g!r} does not hold the KV of {s}")
        self.device, self.weights, self.pool, self.shape = device, weights, pool, s
        self.batch = batch
        self._passed: list = []  # the weight parts run's checks last passed
        f32 = np.float32
        self.x = device.empty((batch, s.d_model), f32)
        self._h = device.empty((batch, s.d_model), f32)
        self._qkv = device.empty((batch, s.matrix_shape("qkv")[0]), f32)
        self.q = device.empty((batch, s.q_heads, s.head_dim), f32)
        self.k = device.empty((batch, s.kv_heads, s.head_dim), f32)
        self.v = device.empty((batch, s.kv_heads, s.head_dim), f32)
        self._attn = device.empty((batch, s.q_heads, s.head_dim), f32)
        self._attn_rows = self._attn.view((batch, s.d_model))
        self._o = device.empty((batch, s.d_model), f32)
        self._gu = device.empty((batch, 2 * s.ffn), f32)
        self._act = device.empty((batch, s.ffn), f32)
        self._down = device.empty((batch, s.d_model), f32)
        self.logits = device.empty((batch, s.vocab), f32)
        self._proj = {name: _Projection(device, weights.fmt, *s.matrix_shape(name), batch,
                                        gemv_rows)
                      for name in (*MATRICES, "lm_head")}
        self.attn = PagedAttention(device, num_seqs=batch, num_heads=s.q_heads,
                                   kv_heads=s.kv_heads, head_dim=s.head_dim,
                                   block_size=g.block_size, max_seq_len=max_seq_len,
                                   kv_dtype=g.dtype)
        if fuse is None:
            fuse = bool(env_bool(FUSE_ENV, True))
        # Prepared-x targets of the fused producers (None: that projection runs unfused); the
        # O projection's producer is attention's reduce, where it fuses (attn.prep_fusable).
        producers = {"qkv": fuse, "gate_up": fuse, "down": fuse, "lm_head": fuse,
                     "o": (fuse and self.attn.prep_fusable
                           and bool(env_bool(FUSE_ATTN_PREP_ENV, False)))}
        self._prepared: dict[str, PreparedX | None] = {
            name: self._proj[name].prepared_x() if on else None
            for name, on in producers.items()}
        self._rope_write = fuse and rope_write_fusable(pool)
        #: The fusions this step runs: ``norm+prep:<projection>``, ``attn+prep:o``,
        #: ``silu+prep:down``, ``rope+kv_write``.
        self.fused = tuple([f"norm+prep:{n}" for n in ("qkv", "gate_up", "lm_head")
                            if self._prepared[n] is not None]
                           + (["attn+prep:o"] if self._prepared["o"] is not None else [])
                           + (["silu+prep:down"] if self._prepared["down"] is not None else [])
                           + (["rope+kv_write"] if self._rope_write else []))
        #: Whether any of its GEMVs rounds x to f16 (``Gemv.f16_x``: the default above 8 rows
        #: per call on NVIDIA), which makes its outputs' error that kernel's, not 2e-5's.
        self.f16_x = any(g.f16_x for p in self._proj.values() for g in p.gemvs.values())

    @property
    def gemv_launches(self) -> dict[str, list[str]]:
        """Per projection (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``), the launch of
        each of its batch chunks' GEMVs (:attr:`Gemv.launch`), in chunk order."""
        return {name: [p.gemvs[hi - lo].launch for lo, hi in p.chunks]
                for name, p in self._proj.items()}

    def __repr__(self) -> str:
        return (f"DecoderStep(batch={self.batch}, {self.shape}, fmt={self.weights.fmt!r}, "
                f"kv={self.pool.geometry.dtype}, gemv_rows={self.gemv_rows}, "
                f"{'f16 x, ' if self.f16_x else ''}fused={list(self.fused)})")

    def run(self, tables: DeviceDecodeBatch, *, stream: StreamLike = None) -> None:
        """One step; ``tables`` must be of the pool's generation (``StaleBlockTable``
        before the first launch otherwise), of ``batch`` sequences, none longer than the
        step's ``max_seq_len`` allows (``InvalidArgument`` before the first launch: the
        pool is not written); every input (:attr:`x`, the weights, the outputs) is checked
        before the first launch too (``InvalidArgument`` naming it, e.g. ``layer 0 qkv: w:
        DeviceArray(...) was freed; ...`` after ``weights.free()``), so a refused step
        launches nothing and leaves the pool and :attr:`x` as they were."""
        self._check(tables)
        s, w = self.shape, self.weights
        for layer in range(s.num_layers):
            lw = w.layers[layer]
            self._norm_project("qkv", lw["qkv"], None if layer == 0 else self._down,
                               w.attn_norm[layer], self._qkv, stream)
            if self._rope_write:
                qkv_rope_write_kv(self.pool, layer, self._qkv, self.q, tables,
                                  q_heads=s.q_heads, theta=s.rope_theta, stream=stream)
            else:
                qkv_rope_split(self.device, self._qkv, tables.positions, self.q, self.k, self.v,
                               q_heads=s.q_heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                               theta=s.rope_theta, stream=stream)
                write_kv(self.pool, layer, self.k, self.v, tables, stream=stream)
            o = self._prepared["o"]
            # the tables were checked against the pool and the attention once, above
            k_pool, v_pool = self.pool.layer(layer)
            if o is not None:
                self.attn.run_prep(self.q, k_pool, v_pool, tables.block_tables,
                                   tables.seq_lens, o, None, stream=stream)
                self._proj["o"].run_prepared(lw["o"], self._o, stream)
            else:
                self.attn.run(self.q, k_pool, v_pool, tables.block_tables, tables.seq_lens,
                              self._attn, stream=stream)
                self._proj["o"](lw["o"], self._attn_rows, self._o, stream)
            self._norm_project("gate_up", lw["gate_up"], self._o, w.ffn_norm[layer], self._gu,
                               stream)
            down = self._prepared["down"]
            if down is not None:
                silu_mul_prep(self.device, self._gu, None, down, stream=stream)
                self._proj["down"].run_prepared(lw["down"], self._down, stream)
            else:
                silu_mul(self.device, self._gu, self._act, stream=stream)
                self._proj["down"](lw["down"], self._act, self._down, stream)
        self._norm_project("lm_head", w.lm_head, self._down, w.final_norm, self.logits, stream)

    def _check(self, tables: DeviceDecodeBatch) -> None:
        """:meth:`run`'s checks, nothing launched: the tables, then each launch's own checks
        of the arrays it takes, prefixed with the layer and part (``layer 1 ffn_norm: ...``)."""
        check_attention(self.attn, self.pool, tables)
        if tables.num_seqs != self.batch:
            raise InvalidArgument(f"tables: {tables.num_seqs} sequences, the step was built "
                                  f"for {self.batch}")
        w, dev = self.weights, self.device
        for name in ("x", "q", "k", "v", "logits"):  # what a caller reaches: x in, outputs
            need_array(getattr(self, name), name, np.float32, writable=True, device=dev)
        # The full checks cost ~45 us a layer of host time; a step whose weight arrays are
        # the ones that passed them last time, none freed since (a freed array's ptr is 0),
        # skips them: nothing else about an array can change after it is made.
        parts, arrays = self._weight_parts()
        if len(parts) == len(self._passed) and all(
                a is b for a, b in zip(parts, self._passed, strict=True)) and all(
                a.ptr or not a.nbytes for a in arrays):
            return
        self._passed = []

        def named(where: str, check, *args) -> None:
            try:
                check(*args)
            except (InvalidArgument, InvalidArgumentType) as err:
                raise type(err)(f"{where}: {err}") from None

        for i, lw in enumerate(w.layers):
            for part, norm in (("attn_norm", w.attn_norm[i]), ("ffn_norm", w.ffn_norm[i])):
                named(f"layer {i} {part}", _check_norm, dev, self.x, None, norm, None, 1)
            for m, y in (("qkv", self._qkv), ("o", self._o), ("gate_up", self._gu),
                         ("down", self._down)):
                named(f"layer {i} {m}", self._proj[m].check, lw[m], y)
        named("final_norm", _check_norm, dev, self.x, None, w.final_norm, None, 1)
        named("lm_head", self._proj["lm_head"].check, w.lm_head, self.logits)
        self._passed = parts

    def _weight_parts(self) -> tuple[list[DeviceArray | GemvWeights], list[DeviceArray]]:
        """The weights' parts the step reads (norm arrays, matrices as uploaded) and their
        device arrays, in order."""
        w = self.weights
        mats = [lw[m] for lw in w.layers for m in ("qkv", "o", "gate_up", "down")]
        parts: list[DeviceArray | GemvWeights] = [*w.attn_norm, *w.ffn_norm, w.final_norm,
                                                  *mats, w.lm_head]
        arrays: list[DeviceArray] = [p.array if isinstance(p, GemvWeights) else p
                                     for p in parts]
        return parts, arrays

    def _norm_project(self, name: str, weight: GemvWeights, residual: DeviceArray | None,
                      norm: DeviceArray, out: DeviceArray, stream: StreamLike) -> None:
        """``x += residual``, RMSNorm, then projection ``name`` of the normalized rows into
        ``out``: two launches when fused (the norm writes the GEMV's prepared x), else the
        norm, the GEMV's prep and the GEMV."""
        prepared = self._prepared[name]
        if prepared is not None:
            add_rmsnorm_prep(self.device, self.x, residual, norm, None, prepared,
                             eps=self.shape.eps, stream=stream)
            self._proj[name].run_prepared(weight, out, stream)
        else:
            add_rmsnorm(self.device, self.x, residual, norm, self._h, eps=self.shape.eps,
                        stream=stream)
            self._proj[name](weight, self._h, out, stream)
