"""The app's `engine` section: `EngineConfig` fields (all but `model`), over a device profile.

`EngineConfig` and `SpecConfig` are the one definition of what an engine field is and which values it
takes; this module only adds the profile defaults and checks a section with those classes when the app's
config loads, so a typo or a bad value fails `serve run` before any replica starts.

Profiles (`engine_profile`): on a CUDA device the fast path (Triton kernels for the LoRA op, attention and
the fused layer ops, CUDA graphs, bfloat16); on a CPU the plain-torch kernels in float32. Both decode with
speculative LoRA-off drafting, its gate deciding per step whether drafting pays, and both cache prompt KV per adapter
version (`enable_prefix_caching`: chat traffic resends system prompts and histories; bench/prefix_load.py measured
shared-prefix chat TTFT p50 0.30x at 1B and 0.32x at 8B on the H200 with the unshared control at 0.95x and 1.01x).
Both run the engine core in a process of its own (`engine_process`), so the replica's Python (Serve's streaming,
detokenizing) never takes the step loop's interpreter.
A field the user sets always wins over the profile.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Mapping, Optional

__all__ = ["FLAT_ALIASES", "engine_fields", "engine_profile", "resolve_engine", "build_engine_config",
           "engine_config", "coerce_engine_value"]

# Speculation as the profiles set it: k = 4 drafts per cycle, the gate picks plain steps where drafting
# cannot pay (a CPU, a batch of base-only requests, adapters whose drafts are rarely accepted).
DEFAULT_SPECULATION = {"num_draft_tokens": 4, "gate": True}

# Top-level AppConfig names of engine fields that deployed configs already use; each is moved into `engine`.
FLAT_ALIASES = ("device", "dtype", "max_loras", "max_lora_rank", "max_cpu_loras", "max_num_seqs", "block_size",
                "num_kv_blocks")


# Scalar annotations of EngineConfig fields -> the types a value must have (a dataclass checks none of them)
_SCALARS = {"bool": (bool,), "int": (int,), "float": (int, float), "int | None": (int, type(None)),
            "float | None": (int, float, type(None)), "str | None": (str, type(None))}


@functools.cache
def engine_fields() -> dict[str, dataclasses.Field]:
    """EngineConfig's settable fields but `model` (imported on first use: engine_ext needs torch)."""
    from engine_ext.config import EngineConfig

    return {f.name: f for f in dataclasses.fields(EngineConfig) if f.init and f.name != "model"}


def engine_profile(device: str, explicit: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Default engine fields for `device`. `explicit`: the fields the user set, which the profile yields to
    where one default depends on another (CUDA graphs need the Triton attention)."""
    explicit = explicit or {}
    profile: dict[str, Any] = {"speculative": dict(DEFAULT_SPECULATION), "enable_prefix_caching": True,
                               "engine_process": True}
    if not device.startswith("cuda"):
        return profile | {"dtype": "float32"}
    profile |= {"dtype": "bfloat16", "lora_backend": "triton", "attn_backend": "triton", "layer_ops": "triton"}
    profile["cuda_graphs"] = explicit.get("attn_backend", profile["attn_backend"]) == "triton"
    return profile


def coerce_engine_value(name: str, value: Any) -> Any:
    """A value from env or `serve run key=value` arrives as a string: JSON-decode it unless the field is a string
    ("null" is None for an optional string: `engine.quantization=null`)."""
    field = engine_fields().get(name)
    if isinstance(value, str) and field is not None and str(field.type) == "str | None" and value == "null":
        return None
    if not isinstance(value, str) or field is None or str(field.type).startswith("str"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def resolve_engine(section: Mapping[str, Any], num_gpus: float = 0.0) -> dict[str, Any]:
    """The profile's defaults under the user's `section` -> every engine field, checked by `EngineConfig`.

    The device defaults to "cuda" when replicas get a GPU (`num_gpus` > 0), else "cpu". Returns plain data
    (JSON-able: `speculative` and `kernels` as dicts) that `build_engine_config` turns into the real config;
    resolving it again gives it back unchanged. Raises ValueError naming the field on anything
    `EngineConfig` refuses.
    """
    fields = engine_fields()
    user = {k: coerce_engine_value(k, v) for k, v in section.items()}
    if "model" in user:
        raise ValueError("engine.model: set the base model with the top-level `model` field")
    unknown = sorted(set(user) - set(fields))
    if unknown:
        raise ValueError(f"engine: unknown field(s) {unknown}; EngineConfig fields are {sorted(fields)}")
    for name, value in user.items():
        types = _SCALARS.get(str(fields[name].type))
        if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            raise ValueError(f"engine.{name} must be {fields[name].type}, got {value!r}")
    device = user.get("device") or ("cuda" if num_gpus > 0 else "cpu")
    merged = engine_profile(device, user) | user | {"device": device}
    spec = merged.get("speculative")
    if isinstance(spec, Mapping):
        from engine_ext.config import SpecConfig

        known = {f.name for f in dataclasses.fields(SpecConfig)}
        if set(spec) - known:
            raise ValueError(f"engine.speculative: unknown field(s) {sorted(set(spec) - known)}; "
                             f"SpecConfig fields are {sorted(known)}")
    # Checked without a model directory: it is known (and checked) where the replica builds its engine,
    # the one EngineConfig with a model it makes (it may exist only on that node).
    config = build_engine_config(merged, None)
    out = {name: getattr(config, name) for name in fields}
    out["kernels"] = dataclasses.asdict(out["kernels"])
    out["speculative"] = None if out["speculative"] is None else dataclasses.asdict(out["speculative"])
    return out


def engine_config(cfg: Any, model_dir: str):
    """The replica's `EngineConfig`: the app's resolved `engine` section (AppConfig.engine) on `model_dir`."""
    return build_engine_config(cfg.engine, model_dir)


def build_engine_config(fields: Mapping[str, Any], model_dir: Optional[str]):
    """`EngineConfig(model=model_dir, **fields)`, its refusals as ValueError("engine: ..."); model_dir None:
    the fields alone, checked by EngineConfig before any model directory is known."""
    from engine_ext.config import EngineConfig

    try:
        return EngineConfig(model=model_dir, **fields)
    except FileNotFoundError:
        raise
    except (TypeError, ValueError) as e:  # a dataclass takes any type: a wrong one fails as TypeError in checks
        raise ValueError(f"engine: {e}") from None
