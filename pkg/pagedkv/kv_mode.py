"""Which KV-cache mode a model runs with: ``PAGEDKV_KV_MODE`` > config > model registry > q8.

docs/kv-quant.md "Choosing a mode". Three knobs, resolved independently, each from the first
source that sets it:

=========  ======================  =====================  =============  =======
knob       env                     alias env              config key     default
=========  ======================  =====================  =============  =======
K mode     ``PAGEDKV_KV_MODE``     ``HIPFIRE_KV_MODE``    ``kv_cache``   ``q8``
V mode     ``PAGEDKV_KV_V``        ``HIPFIRE_KV_V``       ``kv_v``       ``q8``
adaptive   ``PAGEDKV_KV_ADAPTIVE`` ``HIPFIRE_KV_ADAPTIVE`` ``kv_adaptive`` ``off``
=========  ======================  =====================  =============  =======

Order: explicit argument > ``PAGEDKV_*`` > ``HIPFIRE_*`` > per-model config > global config >
the model registry's default (only while the value is unset or ``auto``) > default; a final
``auto`` is ``q8``. A ``HIPFIRE_*`` alias is read only while its ``PAGEDKV_*`` variable is
unset, logged once, and an invalid or unsupported alias value is logged and skipped (hipfire
scripts keep working). Every other bad value (an argument, a ``PAGEDKV_*`` variable, a
config entry, a registry entry) raises :class:`~pagedkv.errors.InvalidArgument` naming where
it came from, the value and what is accepted: a silent fallback would change outputs.

K values: ``q8``, ``fwht4``, ``fwht3``, ``fwht2``, ``auto``, ``bf16`` (an unquantized
bfloat16 cache), and pagedkv's ``lloyd4``/``lloyd3``/``lloyd2`` for K (head_dim 256); the deprecated upstream names ``asym2/3/4``, ``turbo2/3/4`` and ``turbo``
(= 3) mean ``fwhtN`` (accepted, warned once); ``legacy-asym*`` (Givens rotation) and ``fp8``
are refused. V values: ``q8``, ``lloyd4``, ``lloyd3``, ``lloyd2``, ``auto``, ``bf16``, and
pagedkv's ``fwht4``/``fwht2`` for V (head_dim 128 or 256) and ``fwht3`` (head_dim 256,
lloyd3's bytes); a rotated V (lloydN or fwhtN) needs a rotated K. A registry default that
conflicts with an explicit setting of another knob (a pairing rule, kv_adaptive) yields:
K/V to the knob's default, kv_adaptive to ``off``; so does a registry V (rotated or bf16)
over a K nobody set (default or ``auto``: q8).
Adaptive values: :mod:`pagedkv.kv_adaptive`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant.kv import join_kv_dtype

__all__ = [
    "KNOBS",
    "KVModeChoice",
    "Knob",
    "register_model_kv_defaults",
    "registered_model_kv_defaults",
    "resolve_kv_modes",
]

logger = logging.getLogger("pagedkv")


@dataclass(frozen=True)
class Knob:
    """One knob: its env variable, hipfire's alias, config key, default and values."""

    name: str
    env: str
    alias_env: str
    config_key: str
    default: str


KNOBS = {
    "k": Knob("K mode", "PAGEDKV_KV_MODE", "HIPFIRE_KV_MODE", "kv_cache", "q8"),
    "v": Knob("V mode", "PAGEDKV_KV_V", "HIPFIRE_KV_V", "kv_v", "q8"),
    "adaptive": Knob("adaptive", "PAGEDKV_KV_ADAPTIVE", "HIPFIRE_KV_ADAPTIVE", "kv_adaptive",
                     "off"),
}
_K_VALUES = ("q8", "fwht4", "fwht3", "fwht2", "lloyd4", "lloyd3", "lloyd2", "auto", "bf16")
_V_VALUES = ("q8", "lloyd4", "lloyd3", "lloyd2", "fwht4", "fwht3", "fwht2", "auto", "bf16")
# Upstream's deprecated K names (hipfire kv_mode.rs): the same records as fwhtN.
_K_DEPRECATED = {"asym2": "fwht2", "asym3": "fwht3", "asym4": "fwht4", "turbo2": "fwht2",
                 "turbo3": "fwht3", "turbo4": "fwht4", "turbo": "fwht3"}
_REFUSED = {"legacy-asym2": "the Givens-rotation K modes are not implemented (P2)",
            "legacy-asym3": "the Givens-rotation K modes are not implemented (P2)",
            "legacy-asym4": "the Givens-rotation K modes are not implemented (P2)",
            "fp8": "upstream's fp8 KV is an AMD-only E4M3 layout pagedkv does not store"}
_warned: set[str] = set()
_REGISTRY: dict[str, dict[str, str]] = {}


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _normalize(knob: str, raw: object, where: str) -> str:
    """``raw`` as a canonical value of ``knob``; ``InvalidArgument`` naming ``where``."""
    if not isinstance(raw, str):
        raise InvalidArgument(f"{where} = {raw!r}: expected a string")
    value = raw.strip().lower()
    if knob == "adaptive":
        from pagedkv.kv_adaptive import parse_adaptive
        try:
            return parse_adaptive(value).spec
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where} = {raw!r}: {exc}") from None
    accepted = _K_VALUES if knob == "k" else _V_VALUES
    if knob == "k" and value in _K_DEPRECATED:
        _warn_once(f"deprecated:{value}", "KV mode %r is upstream's deprecated name of %r; "
                   "use %r", value, _K_DEPRECATED[value], _K_DEPRECATED[value])
        return _K_DEPRECATED[value]
    if value in _REFUSED:
        raise InvalidArgument(f"{where} = {raw!r} is not supported: {_REFUSED[value]}; "
                              f"accepted: {', '.join(accepted)}")
    if value not in accepted:
        extra = " (or asym2/3/4, turbo2/3/4, turbo)" if knob == "k" else ""
        raise InvalidArgument(f"{where} = {raw!r}: accepted values are "
                              f"{', '.join(accepted)}{extra}")
    return value


def _model_name(model: object) -> str:
    if not isinstance(model, str):
        raise InvalidArgumentType(f"model: expected a model name (a str, e.g. a model_type), "
                                  f"got {type(model).__name__}")
    return model


def _mapping(name: str, value: object, what: str = "with the keys kv_cache, kv_v, "
             "kv_adaptive") -> Mapping[str, object]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentType(f"{name}: expected a mapping {what}, got "
                                  f"{type(value).__name__}")
    return value


def register_model_kv_defaults(model: str, *, kv_cache: str | None = None,
                               kv_v: str | None = None, kv_adaptive: str | None = None) -> None:
    """Record a model's registry defaults (upstream's model-card ``default_kv_mode``): used
    for a knob only while nothing else set it, or set it to ``auto``. ``model`` is the
    name callers pass as ``model`` to :func:`resolve_kv_modes` (e.g. a ``model_type``)."""
    model = _model_name(model)
    entry = {}
    for knob, value in (("k", kv_cache), ("v", kv_v), ("adaptive", kv_adaptive)):
        if value is not None:
            where = f"registry[{model!r}].{KNOBS[knob].config_key}"
            entry[knob] = _normalize(knob, value, where)
    _REGISTRY[model] = entry


def registered_model_kv_defaults(model: str) -> dict[str, str]:
    """The registry entry of ``model`` (knob -> value), empty when none."""
    return dict(_REGISTRY.get(_model_name(model), {}))


@dataclass(frozen=True)
class KVModeChoice:
    """The resolved knobs: ``k``, ``v`` (``"bf16"`` = an unquantized bfloat16 cache),
    ``adaptive`` (``"off"`` or a preset spec) and, per knob, where its value came from."""

    k: str
    v: str
    adaptive: str
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def kv_dtype(self) -> str:
        """The pool dtype: ``"q8"``, ``"bfloat16"`` or ``"<K>/<V>"`` (``"fwht4/lloyd4"``)."""
        if self.k == "bf16":
            return "bfloat16"
        return join_kv_dtype(self.k, self.v)

    def __str__(self) -> str:
        parts = [f"{n}={getattr(self, n)} ({self.sources.get(n, '?')})"
                 for n in ("k", "v", "adaptive")]
        return "KV mode: " + ", ".join(parts)


def _pairing_conflict(k: str, v: str) -> bool:
    """Whether K and V modes cannot make one cache: bf16 on one side only, or a rotated V
    (lloydN, fwhtN) over a K that is not rotated (q8)."""
    return (k == "bf16") != (v == "bf16") or (v not in ("q8", "bf16") and k == "q8")


def resolve_kv_modes(*, k: str | None = None, v: str | None = None,
                     adaptive: str | None = None,
                     model_config: Mapping[str, object] | None = None,
                     global_config: Mapping[str, object] | None = None,
                     model: str | None = None,
                     environ: Mapping[str, str] | None = None) -> KVModeChoice:
    """Resolve the K mode, V mode and adaptive preset (module docstring for the order).

    ``k``/``v``/``adaptive``: explicit arguments (a CLI flag); ``model_config`` and
    ``global_config``: mappings with the keys ``kv_cache``, ``kv_v``, ``kv_adaptive``;
    ``model``: the name of a :func:`register_model_kv_defaults` entry. Checks the pairing
    (a rotated V needs a rotated K, bf16 on one side means bf16 on both) and that adaptive
    runs without an explicit K or V mode."""
    env = os.environ if environ is None else _mapping("environ", environ,
                                                      "of variables, like os.environ")
    model_config = _mapping("model_config", model_config)
    global_config = _mapping("global_config", global_config)
    explicit = {"k": k, "v": v, "adaptive": adaptive}
    registry = _REGISTRY.get(_model_name(model), {}) if model is not None else {}
    out: dict[str, str] = {}
    sources: dict[str, str] = {}
    user_set: dict[str, bool] = {}  # set by the user to a mode; "auto" leaves it to us
    for knob, spec in KNOBS.items():
        value: str | None = None
        source = ""
        candidates: list[tuple[object, str, bool]] = [
            (explicit[knob], f"argument {knob}", False),
            (env.get(spec.env), spec.env, False),
        ]
        if env.get(spec.env) is None:
            candidates.append((env.get(spec.alias_env), spec.alias_env, True))
        candidates += [(model_config.get(spec.config_key),
                        f"model config {spec.config_key}", False),
                       (global_config.get(spec.config_key),
                        f"global config {spec.config_key}", False)]
        for raw, where, alias in candidates:
            if raw is None:
                continue
            try:
                norm = _normalize(knob, raw, where)
            except InvalidArgument as exc:
                if alias:
                    _warn_once(f"alias-bad:{where}={raw}", "ignoring %s=%r: %s", where, raw,
                               exc)
                    continue
                raise
            if alias:
                _warn_once(f"alias:{where}", "using %s=%r (hipfire's name; pagedkv reads "
                           "%s first)", where, raw, spec.env)
            value, source = norm, where
            break
        user_set[knob] = value is not None and value != "auto"
        if (value is None or value == "auto") and knob in registry:
            value, source = registry[knob], f"registry {model!r}"
        if value is None:
            value, source = spec.default, "default"
        elif value == "auto":
            value, source = spec.default, f"{source} (auto)"
        out[knob], sources[knob] = value, source
    # A per-model registry entry is a default: an explicit setting (argument, variable or
    # config) of the other side wins over it instead of conflicting with it (the user cannot
    # unset a registry entry; only explicit settings of both sides are the user's conflict).
    def from_registry(knob: str) -> bool:
        return sources[knob].startswith("registry ")

    def user_chose(knob: str) -> bool:
        return user_set[knob]

    if out["adaptive"] != "off" and from_registry("adaptive") and any(
            user_chose(knob) for knob in ("k", "v")):
        out["adaptive"] = "off"
        sources["adaptive"] += ", overridden by an explicit K/V mode"
    if out["adaptive"] != "off":
        for knob in ("k", "v"):
            if user_chose(knob) or (from_registry(knob) and from_registry("adaptive")):
                raise InvalidArgument(
                    f"kv_adaptive={out['adaptive']!r} ({sources['adaptive']}) picks the K and "
                    f"V modes itself (it starts at fwht4/q8); {KNOBS[knob].name} "
                    f"{out[knob]!r} is set by {sources[knob]}: unset one of them")
        out["k"], out["v"] = "fwht4", "q8"
        sources["k"] = sources["v"] = f"kv_adaptive start tier ({sources['adaptive']})"
    # The same for the K/V pairing rules below: a registry mode that cannot pair with an
    # explicit mode of the other side yields to its knob's default. A registry V also yields
    # to a K nobody set (default or auto: q8), or a registry entry of a rotated or bf16 V
    # without K would fail every resolution that sets no K; a registry K keeps a default V
    # (which follows a bf16 K below).
    for knob, other in (("k", "v"), ("v", "k")):
        yields = user_chose(other) or (knob == "v" and not from_registry(other))
        if from_registry(knob) and yields and _pairing_conflict(out["k"], out["v"]):
            sources[knob] = (f"default, registry {model!r} {KNOBS[knob].name} "
                             f"{out[knob]!r} overridden by {KNOBS[other].name} "
                             f"{out[other]!r} ({sources[other]})")
            out[knob] = KNOBS[knob].default
    if (out["k"] == "bf16") != (out["v"] == "bf16"):
        if out["v"] == "q8" and sources["v"].startswith("default"):
            out["v"], sources["v"] = "bf16", f"follows K bf16 ({sources['k']})"
        else:
            raise InvalidArgument(
                f"K {out['k']!r} ({sources['k']}) with V {out['v']!r} ({sources['v']}): an "
                f"unquantized bf16 cache is bf16 on both sides")
    if _pairing_conflict(out["k"], out["v"]):  # a rotated V over a q8 K
        raise InvalidArgument(
            f"V {out['v']!r} ({sources['v']}) is a rotated V, which needs a rotated K (fwht4, "
            f"fwht3, fwht2 or lloydN); K is {out['k']!r} ({sources['k']})")
    return KVModeChoice(out["k"], out["v"], out["adaptive"], sources)
