"""Lazy reader of a GGUF model for ``pagedkv convert MODEL.gguf`` (docs/formats/gguf.md).

The file is parsed by the ``gguf`` package (llama.cpp's own reader, the optional
extra ``pagedkv[gguf]``), which maps it read-only: tensor headers and metadata come
from its index, payloads stay on disk until a block of rows is asked for. Each
block is dequantized to float32 by ``gguf.quants.dequantize`` (every type llama.cpp
can decode: F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K-quants, the IQ types, ...),
so memory is bounded by the converter's chunk size, not by the tensor.

GGUF names (``blk.N.attn_q.weight``) are mapped to the Hugging Face names the
tensor policy of docs/formats/hfqm.md expects (``model.layers.N.self_attn.q_proj.weight``);
GGUF dims (``ne0`` fastest) are reversed into row-major HF shapes; stacked MoE
experts (``ffn_gate_exps`` [E, I, H]) become one 2-D tensor per expert; the Q/K
rows (and biases) that llama.cpp's converter interleaves for ``llama`` and its
relatives (:data:`PERMUTED_QK_ARCHS`) are put back in HF order. The HF ``config`` is synthesized from the ``<arch>.*`` keys.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
from typing import Any, NamedTuple

import numpy as np

from pagedkv.argument_checks import is_int, row_span
from pagedkv.errors import (
    BadMagic,
    BadMetadata,
    BadName,
    CountMismatch,
    InvalidArgument,
    SizeMismatch,
    Truncated,
    UnknownQuantType,
    UnsupportedQuantType,
    UnsupportedVersion,
)

__all__ = ["GGUF_ARCH_IDS", "PERMUTED_QK_ARCHS", "GgufSource", "GgufTensor", "hf_name",
           "unpermute_rows"]

#: GGUF ``general.architecture`` -> HFQM arch_id (docs/formats/gguf.md); others need --arch.
#: (llama.cpp has no "mistral" architecture: Mistral models are "llama" or "mistral3".)
GGUF_ARCH_IDS: dict[str, int] = {"llama": 0, "qwen3": 1, "qwen2": 7}

#: Architectures whose llama.cpp converter permutes the attn_q/attn_k rows (weights and
#: biases) for its rope: LlamaModel and the subclasses that keep undo_permute (arcee,
#: smollm3, llama-embed, granite, granitemoe, granitehybrid, mistral3's Ministral3Model),
#: and DeciModel and LLaDAModel, which permute the same way (llama.cpp's conversion/*.py).
#: llama4 and apertus turn it off. Mistral's own consolidated format (arch "llama" or
#: "mistral3", undo_permute off) already stores the permuted row order.
PERMUTED_QK_ARCHS = frozenset({"llama", "llama-embed", "arcee", "smollm3", "granite",
                               "granitemoe", "granitehybrid", "deci", "mistral3", "llada"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}
_SLOTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: Gemma 2 on: four norms a block, so ffn_norm is HF's pre_feedforward_layernorm
#: (post_attention_layernorm is post_attention_norm); the gguf package's tensor_mapping.py
#: and constants.py (FFN_PRE_NORM beside ATTN_POST_NORM) say so.
_PRE_FFN_NORM_ARCHS = frozenset({"gemma2", "gemma3", "gemma3n", "gemma4", "gemma-embedding"})
_PRE_FFN_NORM_SLOTS = {"ffn_norm": "pre_feedforward_layernorm"}
#: llama.cpp stores these archs' RMSNorm weights as w + 1 (their HF RMSNorm computes
#: x * (1 + w); conversion/gemma.py adds 1 to every '*norm.weight'; gemma3n and gemma4
#: do not): the reader subtracts it again so the stored weights are the HF ones.
_NORM_PLUS_ONE_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma-embedding"})
_EXPERT_SLOTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
# llama.cpp's shard names (llama_split_path: "%s-%05d-of-%05d.gguf").
_SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_BLOCK = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<slot>[A-Za-z0-9_]+)\.(?P<kind>weight|bias)$")
_FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F32"}
_INT_TYPES = frozenset({"I8", "I16", "I32", "I64"})
#: Types a big-endian file can hold for pagedkv: whole-element arrays, which the gguf
#: package maps in the file's byte order and pagedkv swaps to native. Quantized blocks
#: (and BF16, read as raw bytes) are decoded as little-endian by the package.
_BIG_ENDIAN_TYPES = frozenset({"F32", "F16", "F64", *_INT_TYPES})


class GgufTensor(NamedTuple):
    """One output tensor of a GGUF file (an expert of a stacked tensor counts as one).

    ``dtype`` is what the converter's policy sees (``F32``/``F16``/``BF16`` for
    anything that dequantizes, the GGUF name for integer buffers); ``ggml_type`` is
    the stored type; ``file_index`` its position in the index of ``shard`` (the GGUF
    file that holds it); ``nbytes`` the stored bytes of this (expert's) slice."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    gguf_name: str
    ggml_type: str
    file_index: int
    nbytes: int
    expert: int | None = None
    permute_heads: int = 0
    norm_plus_one: bool = False
    shard: str = ""


def hf_name(gguf_name: str, arch: str = "") -> tuple[str, str | None]:
    """HF name of a GGUF tensor name and, for stacked experts, the per-expert suffix:
    ``("model.layers.N.mlp.experts", "gate_proj.weight")`` names expert e
    ``model.layers.N.mlp.experts.{e}.gate_proj.weight`` (biases likewise); unknown
    names pass through. ``arch`` (``general.architecture``) picks the HF name of the
    slots whose meaning depends on it (gemma2+'s ``ffn_norm``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], None
    m = _BLOCK.match(gguf_name)
    if m is None:
        return gguf_name, None
    layer, slot, kind = m["layer"], m["slot"], m["kind"]
    if slot in _EXPERT_SLOTS:
        return f"model.layers.{layer}.mlp.experts", f"{_EXPERT_SLOTS[slot]}.{kind}"
    slots = {**_SLOTS, **_PRE_FFN_NORM_SLOTS} if arch in _PRE_FFN_NORM_ARCHS else _SLOTS
    return f"model.layers.{layer}.{slots.get(slot, slot)}.{kind}", None


def unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(w, n_head)`` on whole heads of rows: within each
    head of ``d`` rows, GGUF row ``2j + h`` holds HF row ``h·d/2 + j``."""
    d = rows.shape[0] // n_heads
    tail = rows.shape[1:]
    return rows.reshape(n_heads, d // 2, 2, *tail).swapaxes(1, 2).reshape(rows.shape)


def _value(field) -> Any:
    """A GGUF key/value field as plain JSON data (arrays as lists, bytes-free)."""
    from gguf import GGUFValueType
    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        # A nested array comes flattened by the package (its element type is the last).
        if len(field.types) > 1 and field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


def _classify(exc: Exception, path: str, size: int) -> Exception:
    msg = str(exc)
    if "duplicated tensor" in msg:
        return BadName(f"two tensors have one name ({msg}); re-export the model",
                       path=path)
    if isinstance(exc, KeyError) and "Duplicate" in msg:
        return BadMetadata(f"a key/value key appears twice ({exc.args[0] if exc.args else msg}); "
                           "re-export the model", path=path)
    if "is not a multiple of" in msg:
        return SizeMismatch(f"a tensor's row does not split into whole blocks of its type "
                            f"({msg}); the file is corrupt, re-export it", path=path)
    if "magic" in msg.lower():
        return BadMagic(f"not a GGUF file ({msg})", path=path, offset=0)
    if "version" in msg.lower():
        return UnsupportedVersion(f"GGUF version not readable by the gguf package ({msg}); "
                                  "GGUF v2 and v3 are supported", path=path, offset=4)
    if "GGMLQuantizationType" in msg:
        return UnknownQuantType(f"tensor type id unknown to the gguf package ({msg}); upgrade "
                                "gguf (pip install -U gguf) or re-export the model",
                                path=path)
    if "GGUFValueType" in msg or "utf-8" in msg.lower() or "alignment" in msg.lower():
        return BadMetadata(f"GGUF key/value section is corrupt ({msg})", path=path)
    return Truncated(f"GGUF header or tensor data run past the end of the file ({size} "
                     f"bytes; {type(exc).__name__}: {msg})", path=path)


def _synthesize_config(arch: str, meta: dict[str, Any], tensors: dict[str, tuple[int, ...]]
                       ) -> dict[str, Any]:
    """An HF-style ``config`` from the ``<arch>.*`` keys (the fields HFQM loaders read)."""
    def key(name: str) -> Any:
        return meta.get(f"{arch}.{name}")
    config: dict[str, Any] = {"model_type": arch}
    fields = {
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "intermediate_size": key("feed_forward_length"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "vocab_size": key("vocab_size"),
        "max_position_embeddings": key("context_length"),
        "rope_theta": key("rope.freq_base"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "head_dim": key("attention.key_length"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if fields["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if fields["vocab_size"] is None and "token_embd.weight" in tensors:
        fields["vocab_size"] = tensors["token_embd.weight"][0]
    if fields["vocab_size"] is None and isinstance(meta.get("tokenizer.ggml.tokens"), list):
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    heads, hidden = fields["num_attention_heads"], fields["hidden_size"]
    if fields["head_dim"] is None and isinstance(heads, int) and heads and hidden:
        fields["head_dim"] = hidden // heads
    if isinstance(fields["rope_theta"], float):
        fields["rope_theta"] = float(np.float32(fields["rope_theta"]))
    config.update({k: v for k, v in fields.items() if v is not None})
    return config


@functools.cache
def _has_dequantizer(type_name: str) -> bool:
    """Whether ``gguf.quants.dequantize`` decodes GGUF type ``type_name``: one zero block
    is tried once per type (the package knows some types it cannot decode: Q8_1, Q8_K,
    Q1_0 in gguf 0.19)."""
    import gguf
    from gguf.quants import dequantize
    qt = gguf.GGMLQuantizationType[type_name]
    _, size = gguf.GGML_QUANT_SIZES[qt]
    try:
        dequantize(np.zeros((1, size), np.uint8), qt)
    except NotImplementedError:
        return False
    return True


def _open_reader(path: str) -> Any:
    """``gguf.GGUFReader`` of ``path``, its failures as pagedkv errors naming the file."""
    import gguf
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as exc:
        raise _classify(exc, path, os.path.getsize(path)) from None


def _split_field(reader: Any, key: str, path: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = _value(field)
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise BadMetadata(f"GGUF key/value section is corrupt ({exc})", path=path) from None
    if not is_int(value) or value < 0:
        raise BadMetadata(f"{key} is {value!r}, not a count", path=path)
    return int(value)


def _split_fields(reader: Any, path: str) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count) of a gguf-split shard, None for a
    file that is not split (no split.count, or a count of 1)."""
    count = _split_field(reader, "split.count", path)
    if count is None or count == 1:
        return None
    if count == 0:
        raise BadMetadata("split.count is 0", path=path)
    no = _split_field(reader, "split.no", path)
    total = _split_field(reader, "split.tensors.count", path)
    if no is None or total is None:
        raise BadMetadata(f"split.count is {count} but split.no or split.tensors.count is "
                          "missing", path=path)
    return no, count, total


def _shard_paths(path: str, split: tuple[int, int, int] | None) -> list[str]:
    """Every shard of the split model ``path`` belongs to, by llama.cpp's naming rule
    (``NAME-00001-of-00003.gguf``: llama_split_path), in split order."""
    if split is None:
        return [path]
    count = split[1]
    m = _SPLIT_NAME.fullmatch(os.path.basename(path))
    if m is None or int(m["count"]) != count or int(m["no"]) != split[0] + 1:
        raise InvalidArgument(
            f"{path!r} is shard {split[0] + 1} of a {count}-file split GGUF, but its name "
            f"does not follow llama.cpp's NAME-{split[0] + 1:05d}-of-{count:05d}.gguf, so "
            "its siblings cannot be found; rename the shards or merge them with "
            "llama-gguf-split --merge")
    prefix = os.path.join(os.path.dirname(path), m["prefix"])
    paths = [f"{prefix}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)]
    for k, shard in enumerate(paths, 1):
        if not os.path.isfile(shard):
            raise InvalidArgument(f"shard {k} of {count} of the split GGUF {path!r} is "
                                  f"missing: {shard!r}")
    return paths


def _check_split(reader: Any, path: str, no: int, split: tuple[int, int, int]) -> None:
    """A shard's own split.no/count/tensors.count agree with its place in the split."""
    mine = _split_fields(reader, path)
    if mine != (no, split[1], split[2]):
        raise BadMetadata(f"split keys (split.no, split.count, split.tensors.count) are "
                          f"{mine}, expected {(no, split[1], split[2])} for shard {no + 1} "
                          f"of {split[1]}", path=path)


class GgufSource:
    """A GGUF model: ``GgufSource(path)``. ``tensors`` (HF names, file order),
    ``config`` (synthesized), ``metadata`` (the raw key/value tree, of the first shard),
    ``architecture``, ``shards`` (the files read).

    ``path`` may be any shard of a split model (llama.cpp's gguf-split: ``split.count``
    keys, files ``NAME-0000k-of-0000n.gguf``): every shard is opened by that naming
    rule, each one's ``split.no``/``split.count`` checked and the tensors counted
    against ``split.tensors.count``.

    Raises :class:`~pagedkv.errors.BadMagic`, ``UnsupportedVersion``, ``Truncated``,
    ``BadMetadata``, ``CountMismatch`` or ``UnknownQuantType`` on a broken file,
    ``UnsupportedQuantType`` for a tensor type the gguf package cannot dequantize (or a
    quantized tensor of a big-endian file), and ``InvalidArgument`` for a missing shard,
    before anything is read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            import gguf
        except ImportError:  # pragma: no cover - the extra is installed with [test]
            raise InvalidArgument("reading GGUF needs the gguf package: "
                                  "pip install 'pagedkv[gguf]'") from None
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise InvalidArgument(f"{self.path!r} does not exist or is not a file")
        given = _open_reader(self.path)
        split = _split_fields(given, self.path)
        #: every file of the model, in split order (one for an unsplit file)
        self.shards: list[str] = _shard_paths(self.path, split)
        # shard path -> its gguf.GGUFReader (the package ships no type stubs)
        self._readers: dict[str, Any] = {}
        for no, shard in enumerate(self.shards):
            reader = given if shard == self.path else _open_reader(shard)
            if split is not None:
                _check_split(reader, shard, no, split)
            self._readers[shard] = reader
        first = self._readers[self.shards[0]]
        try:
            # GGUF.* (header fields) and split.* (the source's file layout) describe the
            # files, not the model: a split source makes one HFQM file.
            self.metadata: dict[str, Any] = {
                name: _value(field) for name, field in first.fields.items()
                if not name.startswith(("GGUF.", "split."))}
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise BadMetadata(f"GGUF key/value section is corrupt ({exc})",
                              path=self.shards[0]) from None
        for key, value in self.metadata.items():
            # The tree is stored as the gguf_meta JSON, which has no NaN or Infinity:
            # refuse here, naming the key, not when the writer serializes it.
            if any(isinstance(v, float) and not math.isfinite(v)
                   for v in (value if isinstance(value, list) else [value])):
                raise BadMetadata(f"key {key!r} holds a NaN or infinite float, which HFQM "
                                  "metadata (JSON) cannot store", path=self.shards[0])
        arch = self.metadata.get("general.architecture")
        self.architecture: str = arch if isinstance(arch, str) and arch else "unknown"
        shapes: dict[str, tuple[int, ...]] = {}
        for shard, reader in self._readers.items():
            for t in reader.tensors:
                if t.name in shapes:
                    raise BadMetadata("tensor appears in more than one shard", path=shard,
                                      tensor=t.name)
                shapes[t.name] = tuple(int(d) for d in reversed(t.shape.tolist()))
                if math.prod(d for d in shapes[t.name] if d) * 4 > np.iinfo(np.intp).max:
                    # Only a zero dim lets such a tensor have a size the file can hold.
                    raise BadMetadata(f"shape {shapes[t.name]} is too large for any array; "
                                      "the tensor header is corrupt", path=shard,
                                      tensor=t.name)
        if split is not None and len(shapes) != split[2]:
            raise CountMismatch(f"the {split[1]} shards hold {len(shapes)} tensors, "
                                f"split.tensors.count says {split[2]}", path=self.shards[0])
        self.config = _synthesize_config(self.architecture, self.metadata, shapes)
        self.tokenizer = "{}"
        self.tokenizer_config = None
        self.generation_config = None
        self.tensors: list[GgufTensor] = []
        for shard, reader in self._readers.items():
            size = os.path.getsize(shard)
            outputs: list[GgufTensor] = []
            for i, t in enumerate(reader.tensors):
                end = t.data_offset + t.n_bytes
                rel = int(t.data_offset) - int(reader.data_offset)
                if rel % int(reader.alignment):
                    # GGUF places every tensor at a multiple of general.alignment, and
                    # llama.cpp's loader refuses any other offset: the info is corrupt.
                    raise BadMetadata(f"tensor data offset {rel} is not a multiple of the "
                                      f"file's alignment ({int(reader.alignment)}); the "
                                      "file is corrupt, re-export it", path=shard,
                                      tensor=t.name, offset=int(t.data_offset))
                if end > size:
                    raise Truncated(f"tensor data [{t.data_offset}, {end}) runs past the end "
                                    f"of the file ({size} bytes)", path=shard, tensor=t.name,
                                    offset=t.data_offset)
                if reader.endianess == gguf.GGUFEndian.BIG and (
                        t.tensor_type.name not in _BIG_ENDIAN_TYPES):
                    raise UnsupportedQuantType(
                        f"big-endian GGUF with a {t.tensor_type.name} tensor: its blocks would "
                        "be decoded as little-endian; convert the file to little-endian first "
                        "(gguf-py's gguf_convert_endian.py)", path=shard, tensor=t.name)
                if (t.tensor_type.name not in _BIG_ENDIAN_TYPES and t.tensor_type.name
                        not in ("BF16", "Q4_K") and not _has_dequantizer(t.tensor_type.name)):
                    # Refused here, before any tensor is encoded, not when its rows are read.
                    raise self._no_dequantizer(t.tensor_type.name, shard, t.name)
                outputs.extend(self._outputs(shard, i, t, shapes[t.name]))
            # File order within a shard, shards in split order.
            offsets = [int(t.data_offset) for t in reader.tensors]
            # llama.cpp's loader refuses tensor data that overlaps (it lays tensors out
            # back to back): two names on one range would convert one tensor's bytes twice.
            ranges = sorted((offsets[i], offsets[i] + int(t.n_bytes), t.name)
                            for i, t in enumerate(reader.tensors) if int(t.n_bytes))
            for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
                if start < end:
                    raise BadMetadata(f"the data of tensors {first!r} and {second!r} overlap "
                                      f"(the first ends at {end}, the second starts at "
                                      f"{start}); the file is corrupt, re-export it",
                                      path=shard, tensor=second, offset=start)
            outputs.sort(key=lambda x: (offsets[x.file_index],
                                        x.expert if x.expert is not None else -1))
            self.tensors.extend(outputs)

    def _outputs(self, shard: str, index: int, t, shape: tuple[int, ...]) -> list[GgufTensor]:
        type_name = t.tensor_type.name
        if type_name in _INT_TYPES:
            dtype = type_name
        else:
            dtype = _FLOAT_TYPES.get(type_name, "F32")
        name, expert_suffix = hf_name(t.name, self.architecture)
        if expert_suffix is not None:
            # Stacked experts: weights [E, M, K], biases [E, M] (gpt-oss); one output each.
            rank = 3 if expert_suffix.endswith(".weight") else 2
            if len(shape) != rank or not shape[0]:
                raise BadMetadata(f"stacked expert tensor has shape {shape}, not "
                                  f"{'[E, M, K]' if rank == 3 else '[E, M]'} with E > 0",
                                  path=shard, tensor=t.name)
            per = t.n_bytes // shape[0]
            return [GgufTensor(f"{name}.{e}.{expert_suffix}", dtype, shape[1:], t.name,
                               type_name, index, per, e, shard=shard)
                    for e in range(shape[0])]
        heads = 0
        block = _BLOCK.match(t.name)
        # Weights [rows, K] and biases [rows] alike: llama.cpp permutes both.
        if self.architecture in PERMUTED_QK_ARCHS and block and len(shape) in (1, 2):
            key = {"attn_q": "attention.head_count",
                   "attn_k": "attention.head_count_kv"}.get(block["slot"])
            if key is not None:
                n = self._layer_heads(key, int(block["layer"]))
                if not is_int(n) or n <= 0 or shape[0] % n or (shape[0] // n) % 2:
                    raise BadMetadata(f"{shape[0]} rows do not split into {n} heads of an even "
                                      f"size ({self.architecture}.{key})", path=shard,
                                      tensor=t.name)
                heads = int(n)
        plus_one = (self.architecture in _NORM_PLUS_ONE_ARCHS
                    and t.name.endswith("norm.weight") and dtype in ("F32", "F16", "BF16"))
        return [GgufTensor(name, dtype, shape, t.name, type_name, index, int(t.n_bytes),
                           None, heads, plus_one, shard)]

    def _layer_heads(self, key: str, layer: int) -> Any:
        """Head count ``<arch>.<key>`` of ``layer`` (K falls back to Q's): a number, or a
        per-layer array (deci, granitehybrid)."""
        n = self.metadata.get(f"{self.architecture}.{key}")
        if n is None and key.endswith("_kv"):
            n = self.metadata.get(f"{self.architecture}.attention.head_count")
        if isinstance(n, list):
            n = n[layer] if layer < len(n) else None
        return n

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def _dequantize(self, tensor: GgufTensor, raw: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        if tensor.ggml_type in ("F32", "F16") or tensor.ggml_type in _INT_TYPES:
            # F16 stays float16 (exact; the codecs take it). A big-endian file maps as
            # '>f4' etc.: the copy is in native order, the one the codecs take.
            return np.array(raw, dtype=raw.dtype.newbyteorder("="))
        if tensor.ggml_type == "F64":
            return np.asarray(raw, dtype=np.float32)
        if raw.size == 0:
            # A zero-size tensor (or block): the package's decoders cannot reshape nothing.
            import gguf
            block, size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[tensor.ggml_type]]
            return np.zeros((*raw.shape[:-1], raw.shape[-1] // size * block), np.float32)
        if tensor.ggml_type == "Q4_K":
            # One Q4_K decoder in the project: pagedkv.quant's qt 4 (docs/formats/quant.md,
            # "Q4K"), bit for bit the gguf package's, and the one the GPU kernel shares.
            from pagedkv.quant import dequantize as decode_qt
            rows = np.ascontiguousarray(raw, dtype=np.uint8)
            shape = (*rows.shape[:-1], rows.shape[-1] // 144 * 256)
            return decode_qt(rows.reshape(-1), "q4k", shape)
        try:
            return dequantize(np.asarray(raw), GGMLQuantizationType[tensor.ggml_type])
        except NotImplementedError:
            raise self._no_dequantizer(tensor.ggml_type, tensor.shard,
                                       tensor.gguf_name) from None

    @staticmethod
    def _no_dequantizer(type_name: str, shard: str, name: str) -> UnsupportedQuantType:
        return UnsupportedQuantType(
            f"GGUF type {type_name} has no dequantizer in the gguf package; re-export the "
            "model as F16/BF16/Q8_0 or upgrade gguf", path=shard, tensor=name)

    def read(self, tensor: GgufTensor,
             index: tuple[slice | int, ...] | None = None) -> np.ndarray:
        """Rows of ``tensor`` as float32 (F16 stays float16), in HF order: ``index``
        selects along the leading dim (``(slice(r0, r1),)``); ``None`` reads it whole.
        For a stacked expert the leading int of ``index`` is ignored (the tensor
        already names its expert). A Gemma norm stored as ``w + 1`` comes back as
        ``w`` (float32). A row index outside ``-rows..rows-1`` raises
        :class:`~pagedkv.errors.InvalidArgument` (a non-int one ``InvalidArgumentType``),
        as does a slice with a step other than 1."""
        out = self._read_rows(tensor, index)
        if tensor.norm_plus_one:
            return np.subtract(out, np.float32(1), dtype=np.float32)
        return out

    def _read_rows(self, tensor: GgufTensor,
                   index: tuple[slice | int, ...] | None) -> np.ndarray:
        data = self._readers[tensor.shard].tensors[tensor.file_index].data
        if tensor.expert is not None:
            data = data[tensor.expert]
            if index is not None and index and isinstance(index[0], (int, np.integer)):
                index = index[1:]
        rows = index[0] if index else slice(None)
        n = tensor.shape[0] if tensor.shape else 1
        lo, hi = row_span(rows, n, tensor.name)
        if len(tensor.shape) < 2:
            whole = self._dequantize(tensor, data).reshape(tensor.shape)
            if tensor.permute_heads:
                whole = unpermute_rows(whole, tensor.permute_heads)
            return whole[lo:hi] if tensor.shape and (lo, hi) != (0, n) else whole
        if tensor.permute_heads and n:
            # The permutation stays inside a head: read whole heads, then cut.
            d = n // tensor.permute_heads
            h0, h1 = lo // d * d, -(-hi // d) * d
            block = self._dequantize(tensor, data[h0:h1])
            block = unpermute_rows(block.reshape(h1 - h0, -1), (h1 - h0) // d)
            out = block[lo - h0:hi - h0]
        else:
            out = self._dequantize(tensor, data[lo:hi])
        return out.reshape((hi - lo, *tensor.shape[1:]))

    def __repr__(self) -> str:
        return (f"<GgufSource {self.path!r}: {self.architecture}, {len(self.shards)} shards, "
                f"{len(self.tensors)} tensors, {self.total_bytes} bytes>")
