"""PEFT `LoraConfig` -> which modules carry a LoRA, with which rank and scale: served exactly as PEFT serves it,
or refused with a message naming the field. One place, used by the engine's loader (`lora_adapter.py`) and the
registry's validator, so both give the same verdict for the same files.

Every field of `adapter_config.json` falls in one of three sets:
- honoured: r, lora_alpha (int or float), use_rslora, target_modules (list, regex string, "all-linear"),
  exclude_modules, layers_to_transform, layers_pattern, rank_pattern, alpha_pattern;
- inert at inference (training or bookkeeping only): task_type, base_model_name_or_path, revision, lora_dropout,
  inference_mode, ...; init_lora_weights only for the plain inits (the others rewrite the base weights);
- anything else is refused unless absent or at its no-op default (null, false, [], {}), which covers DoRA,
  bias, lora_bias, modules_to_save, trainable tokens, layer_replication, target_parameters and fields PEFT adds
  later. Embedding and lm_head targets are refused by name.

Targets follow `peft.tuners.tuners_utils.check_target_module_exists` and ranks/alphas
`peft.utils.other.get_pattern_key`, applied to the module names of the base model's `named_modules()`.
Registrant-supplied regexes run under the `regex` engine's timeout (catastrophic backtracking is refused).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import regex

from .constants import LORA_MODULES, MODULE_PARENT

__all__ = ["LoraConfigError", "ModulePlan", "LoraPlan", "plan_adapter", "parse_tensor_name", "match_tensors",
           "HONOURED_FIELDS", "INERT_FIELDS"]

HONOURED_FIELDS = frozenset({"r", "lora_alpha", "use_rslora", "target_modules", "exclude_modules",
                             "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "peft_type"})
INERT_FIELDS = frozenset({"task_type", "base_model_name_or_path", "revision", "inference_mode", "lora_dropout",
                          "auto_mapping", "peft_version", "runtime_config", "megatron_core", "qalora_group_size",
                          "fan_in_fan_out", "init_lora_weights", "loftq_config", "eva_config", "corda_config",
                          "lora_ga_config"})
# Inits that only shape the starting point of training; the saved factors replace them. Other inits (PiSSA,
# OLoRA, LoftQ, CorDA, EVA, LoRA-GA, ...) also rewrite the base weights, which serving cannot reproduce.
_PLAIN_INITS = (True, False, "gaussian")
# Named for a clearer refusal than "non-default field".
_REFUSED = {"use_dora": "DoRA (use_dora)", "bias": "trained biases (bias)", "lora_bias": "LoRA biases (lora_bias)",
            "modules_to_save": "fully trained modules (modules_to_save)",
            "trainable_token_indices": "trainable tokens (trainable_token_indices)",
            "layer_replication": "layer replication (layer_replication)",
            "target_parameters": "LoRA on parameters (target_parameters)",
            "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)"}
_EMBEDDINGS = ("embed_tokens", "lm_head")
_MAX_PATTERN_CHARS = 1024
_MATCH_TIMEOUT_S = 1.0
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight, exactly as PEFT's save_pretrained writes it.
_TENSOR_RE = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+))\.lora_(A|B)\.weight$")


class LoraConfigError(ValueError):
    """An adapter that cannot be served exactly as PEFT would serve it. `code` is the registry's error code."""

    def __init__(self, message: str, code: str = "bad_config"):
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class ModulePlan:
    rank: int
    alpha: float
    scale: float  # alpha / rank, or alpha / sqrt(rank) with use_rslora


@dataclass(frozen=True)
class LoraPlan:
    modules: dict[str, ModulePlan]  # "model.layers.3.self_attn.q_proj" -> its rank and scale
    lora_alpha: float

    @property
    def max_rank(self) -> int:
        return max(p.rank for p in self.modules.values())

    @property
    def target_modules(self) -> list[str]:
        return sorted({path.rsplit(".", 1)[1] for path in self.modules})


def _is_noop(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == "" or value == "none"


def _compile(pattern: str, what: str) -> regex.Pattern:
    if len(pattern) > _MAX_PATTERN_CHARS:
        raise LoraConfigError(f"{what} is longer than {_MAX_PATTERN_CHARS} characters")
    try:
        re.compile(pattern)  # PEFT uses `re`: what it cannot compile, it cannot serve
        return regex.compile(pattern)
    except (re.error, regex.error) as e:
        raise LoraConfigError(f"{what} {pattern!r} is not a valid regular expression: {e}") from e


def _search(fn, text: str, what: str):
    try:
        return fn(text, timeout=_MATCH_TIMEOUT_S)
    except TimeoutError as e:
        raise LoraConfigError(f"{what} takes too long to match module names (catastrophic backtracking?)") from e


def _number(cfg: dict, key: str, default, kinds: tuple[type, ...]) -> Any:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or not math.isfinite(value):
        raise LoraConfigError(f"field {key!r} must be a positive {' or '.join(k.__name__ for k in kinds)}, "
                              f"got {value!r}")
    return value


def _str_list(cfg: dict, key: str, allow_str: bool) -> list[str] | str | None:
    value = cfg.get(key)
    if value is None or (allow_str and isinstance(value, str)):
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise LoraConfigError(f"field {key!r} must be a list of strings{' or a regex string' if allow_str else ''}, "
                              f"got {value!r}")
    return value


def _check_fields(cfg: dict) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraConfigError(f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    for key, what in _REFUSED.items():
        if not _is_noop(cfg.get(key)):
            raise LoraConfigError(f"{what} is not served: {key}={cfg[key]!r}")
    if cfg.get("init_lora_weights", True) not in _PLAIN_INITS:
        raise LoraConfigError(f"init_lora_weights={cfg['init_lora_weights']!r} rewrites the base model's weights "
                              f"when PEFT loads the adapter; only {list(_PLAIN_INITS)} are served")
    if cfg.get("fan_in_fan_out", False) is not False:
        raise LoraConfigError("fan_in_fan_out=true does not fit Llama-family linears (PEFT would refuse it too)")
    for key in ("loftq_config", "eva_config", "corda_config", "lora_ga_config"):
        if not _is_noop(cfg.get(key)):
            raise LoraConfigError(f"field {key!r} belongs to an initialisation that is not served")
    unknown = sorted(k for k, v in cfg.items() if k not in HONOURED_FIELDS | INERT_FIELDS | set(_REFUSED)
                     and not _is_noop(v) and not k.startswith("_"))
    if unknown:
        raise LoraConfigError(f"fields {unknown} are not known to be inert at inference; refused rather than "
                              f"served differently from PEFT")


def _other_module_names(num_layers: int) -> list[str]:
    """Modules of a Llama-family model that are not LoRA-servable projections (named_modules() names)."""
    names = ["", "model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        names += [p, f"{p}.self_attn", f"{p}.mlp", f"{p}.mlp.act_fn", f"{p}.input_layernorm",
                  f"{p}.post_attention_layernorm", f"{p}.self_attn.q_norm", f"{p}.self_attn.k_norm"]
    return names


def _layer_index(key: str, layers_pattern: list[str] | str | None) -> int | None:
    # peft.tuners.tuners_utils.check_target_module_exists: the first numbered segment after the pattern.
    if not layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
    else:
        m = None
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if m is not None:
                break
    return int(m.group("idx")) if m else None


def _targeted(key: str, targets, excluded, layers, layers_pattern) -> bool:
    if excluded is not None:
        if isinstance(excluded, regex.Pattern):
            if _search(excluded.fullmatch, key, "exclude_modules regex"):
                return False
        elif key in excluded or any(key.endswith(f".{e}") for e in excluded):
            return False
    if isinstance(targets, regex.Pattern):
        return bool(_search(targets.fullmatch, key, "target_modules regex"))
    if key in targets:  # a full module name bypasses layers_to_transform, as in PEFT
        return True
    if not any(key.endswith(f".{t}") for t in targets):
        return False
    if layers is None or layers == []:
        return True
    index = _layer_index(key, layers_pattern)
    return index is not None and (index == layers if isinstance(layers, int) else index in layers)


def _pattern_value(patterns: dict, compiled: dict, key: str, default):
    # peft.utils.other.get_pattern_key: the first key matching a dotted suffix, else the full name itself.
    for k in patterns:
        if _search(compiled[k].match, key, f"pattern key {k!r}"):
            return patterns[k]
    return patterns.get(key, default)


def plan_adapter(cfg: Any, num_layers: int) -> LoraPlan:
    """adapter_config.json (parsed) -> the modules PEFT would wrap on a `num_layers` Llama-family model, each
    with its rank and scale. Raises LoraConfigError naming the field it cannot honour."""
    if not isinstance(cfg, dict):
        raise LoraConfigError("adapter_config.json must hold a JSON object")
    _check_fields(cfg)
    r = _number(cfg, "r", 8, (int,))
    alpha = _number(cfg, "lora_alpha", 8, (int, float))
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraConfigError(f"field 'use_rslora' must be true or false, got {rslora!r}")
    targets = _str_list(cfg, "target_modules", allow_str=True)
    if targets is None or targets == []:
        raise LoraConfigError("field 'target_modules' is missing or empty", "unknown_target_module")
    excluded = _str_list(cfg, "exclude_modules", allow_str=True)
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool) and layers >= 0) and not (
            isinstance(layers, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
        raise LoraConfigError(f"field 'layers_to_transform' must be a layer index or a list of them, got {layers!r}")
    layers_pattern = _str_list(cfg, "layers_pattern", allow_str=True)
    if isinstance(targets, str) and (layers is not None or layers_pattern is not None):
        raise LoraConfigError("layers_to_transform / layers_pattern cannot be used with a regex target_modules "
                              "(PEFT refuses this config)")
    if layers_pattern and layers is None:
        raise LoraConfigError("layers_pattern needs layers_to_transform (PEFT refuses this config)")
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(field) or {}
        kinds = (int,) if field == "rank_pattern" else (int, float)
        if not isinstance(value, dict) or not all(isinstance(v, kinds) and not isinstance(v, bool) and v > 0
                                                  and math.isfinite(v) for v in value.values()):
            raise LoraConfigError(f"field {field!r} must map module patterns to positive numbers, got {value!r}")
        patterns[field] = value
    compiled = {k: _compile(rf"(.*\.)?({k})$", f"{f} key") for f in patterns for k in patterns[f]}
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(LORA_MODULES)  # every linear but the output embedding, which PEFT leaves out
    if isinstance(targets, str):
        targets = _compile(targets, "target_modules regex")
    elif any(t.split(".")[-1] in _EMBEDDINGS for t in targets):
        raise LoraConfigError(f"embedding and lm_head targets are not served: target_modules {targets}",
                              "unknown_target_module")
    if isinstance(excluded, str):
        excluded = _compile(excluded, "exclude_modules regex")

    modules: dict[str, ModulePlan] = {}
    for layer in range(num_layers):
        for module in LORA_MODULES:
            key = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
            if not _targeted(key, targets, excluded, layers, layers_pattern):
                continue
            mr = _pattern_value(patterns["rank_pattern"], compiled, key, r)
            ma = _pattern_value(patterns["alpha_pattern"], compiled, key, alpha)
            modules[key] = ModulePlan(rank=mr, alpha=float(ma), scale=ma / math.sqrt(mr) if rslora else ma / mr)
    others = [k for k in _other_module_names(num_layers) if _targeted(k, targets, excluded, layers, layers_pattern)]
    if others:
        what = "embedding and lm_head targets are" if any(o.endswith(_EMBEDDINGS) for o in others) else \
            "targets other than the attention and MLP projections are"
        raise LoraConfigError(f"{what} not served: target_modules matches {others[:4]}", "unknown_target_module")
    if not isinstance(targets, regex.Pattern):
        # An entry naming no projection at all is a typo; one whose modules are all excluded is PEFT's business.
        every = [f"model.layers.{i}.{MODULE_PARENT[m]}.{m}" for i in range(num_layers) for m in LORA_MODULES]
        unmatched = [t for t in targets if not any(k == t or k.endswith(f".{t}") for k in every)]
        if unmatched:
            raise LoraConfigError(f"unknown target module(s) {unmatched}: they match no servable module "
                                  f"(known: {list(LORA_MODULES)})", "unknown_target_module")
    if not modules:
        raise LoraConfigError(f"target_modules {cfg['target_modules']!r} (with exclude_modules and "
                              f"layers_to_transform) matches no module of the model", "unknown_target_module")
    return LoraPlan(modules=modules, lora_alpha=float(alpha))


def parse_tensor_name(name: str) -> tuple[str, int, str, str] | None:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> (module path, 3, 'q_proj', 'A')."""
    m = _TENSOR_RE.match(name)
    if m is None or MODULE_PARENT.get(m.group(4)) != m.group(3):
        return None
    return m.group(1), int(m.group(2)), m.group(4), m.group(5)


def match_tensors(plan: LoraPlan, shapes: dict[str, list[int]], module_shapes: dict[str, tuple[int, int]]
                  ) -> dict[str, dict[str, str]]:
    """Check a weights file's tensors (name -> shape) against the plan: each must be lora_A [rank, in] or
    lora_B [out, rank] of a planned module, and each planned module needs both. -> {module path: {"A", "B": name}}.
    Tensors the config does not target are refused: PEFT would silently drop them."""
    found: dict[str, dict[str, str]] = {}
    for name, shape in shapes.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise LoraConfigError(f"unexpected tensor {name!r} (not a LoRA factor of an attention or MLP "
                                  f"projection, named as PEFT saves it)", "tensor_mismatch")
        path, _, module, factor = parsed
        plan_m = plan.modules.get(path)
        if plan_m is None:
            raise LoraConfigError(f"tensor {name!r} is for {path}, which the config does not target "
                                  f"(target_modules, exclude_modules, layers_to_transform); PEFT would ignore it",
                                  "tensor_mismatch")
        fan_in, fan_out = module_shapes[module]
        want = [plan_m.rank, fan_in] if factor == "A" else [fan_out, plan_m.rank]
        if list(shape) != want:
            raise LoraConfigError(f"tensor {name!r} has shape {list(shape)}, expected {want} (rank {plan_m.rank} "
                                  f"from the config)", "shape_mismatch")
        found.setdefault(path, {})[factor] = name
    missing = sorted(f"{p}.lora_{f}" for p in plan.modules for f in "AB" if f not in found.get(p, {}))
    if missing:
        raise LoraConfigError(f"the config targets modules the weights file has no factors for: {missing[:4]}"
                              f"{' ...' if len(missing) > 4 else ''}", "tensor_mismatch")
    return found
