"""Shape and numerics of the reference transformer (saved as ``config.json``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pagedkv.errors import BadMetadata, InvalidArgument, TopologyError

__all__ = ["MODEL_TYPE", "ReferenceConfig"]

#: ``model_type`` written to ``config.json``; the cold tier fingerprints models by it.
MODEL_TYPE = "pagedkv_reference"


@dataclass(frozen=True)
class ReferenceConfig:
    """A tiny decoder-only transformer: GQA attention with RoPE, SwiGLU MLP, tied LM head.

    The defaults keep a forward pass of one token well under a millisecond on one CPU core,
    which is what `pagedkv demo` and the parity tests need.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        # bool is an int subclass: a config.json "num_layers": true must not become 1 layer.
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"ReferenceConfig.{name} = {value!r}: must be an int > 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgument(f"ReferenceConfig.seed = {self.seed!r}: must be an int >= 0 "
                                  "(it seeds numpy.random.default_rng)")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < float("inf")):
                raise InvalidArgument(f"ReferenceConfig.{name} = {value!r}: must be a finite "
                                      "number > 0")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"ReferenceConfig.num_heads = {self.num_heads} must be a multiple of "
                f"num_kv_heads = {self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise InvalidArgument(
                f"ReferenceConfig.head_dim = {self.head_dim} must be even (RoPE rotates pairs)")

    @property
    def queries_per_kv_head(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model_type"] = MODEL_TYPE
        d["dtype"] = "float32"
        d["tie_word_embeddings"] = True
        return d

    @classmethod
    def from_json_dict(cls, d: object, *, path: str | None = None) -> ReferenceConfig:
        if not isinstance(d, dict) or d.get("model_type") != MODEL_TYPE:
            got = d.get("model_type") if isinstance(d, dict) else type(d).__name__
            raise BadMetadata(f"model_type is {got!r}, expected {MODEL_TYPE!r}", path=path)
        if cls is ReferenceConfig and "layer_types" in d:
            # A hybrid model saves its layer kinds under the same model_type; read as a plain
            # config it would silently lose them.
            raise BadMetadata("the config has layer_types (a hybrid model): read it with "
                              "pagedkv.tiny_model.config_from_json_dict or "
                              "HybridConfig.from_json_dict", path=path)
        fields = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in fields})
        except (TypeError, InvalidArgument, TopologyError) as e:
            raise BadMetadata(f"invalid reference config: {e}", path=path) from e

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n"
