"""Checking staged adapter files against the registrant's sha256 values and the base-model spec.

Order matters: cheap, content-free checks first (file names and types, hashes), then the config, then the
safetensors headers (bounded reads), and only then loading tensor data (NaN/Inf), so hostile files are refused
before a parser spends effort on them. Every refusal is a RegistryValidationError whose code names the problem.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import regex
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from registry.base_model import BaseModelSpec
from registry.errors import RegistryValidationError
from registry.records import FileEntry
from registry.safetensors_header import TensorInfo, read_header

__all__ = ["ValidatedAdapter", "PeftAdapterConfig", "validate_adapter", "sha256_file", "check_file_set",
           "module_paths", "targeted_modules", "module_ranks", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DOC_FILES = frozenset({"README.md"})
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# PEFT's saved key for a LoRA factor of a decoder-layer linear (adapter name already stripped).
_TENSOR_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+)\.lora_(A|B)\.weight$")
# Registrant-supplied regexes (target_modules string, rank/alpha_pattern keys) run against a few hundred short
# module names; the `regex` engine's timeout bounds catastrophic backtracking, the length cap bounds compiling.
_MAX_PATTERN_CHARS = 1024
_MATCH_TIMEOUT_S = 1.0


class PeftAdapterConfig(BaseModel):
    """The fields of PEFT's adapter_config.json the serving engine relies on; strict types, extra fields kept."""

    model_config = ConfigDict(extra="allow")
    peft_type: StrictStr = "LORA"
    r: StrictInt
    lora_alpha: StrictInt | StrictFloat
    target_modules: list[StrictStr] | StrictStr
    base_model_name_or_path: StrictStr | None = None
    bias: StrictStr = "none"
    use_dora: StrictBool = False
    modules_to_save: list[StrictStr] | None = None
    rank_pattern: dict[str, StrictInt] = {}
    alpha_pattern: dict[str, StrictInt | StrictFloat] = {}


class ValidatedAdapter(BaseModel):
    rank: int
    alpha: float
    target_modules: list[str]
    dtype: str
    files: dict[str, FileEntry]


def _fail(msg: str, code: str) -> RegistryValidationError:
    return RegistryValidationError(msg, code=code)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_file_set(names: list[str], declared: dict[str, str]) -> None:
    """Every file must be of an allowed type and have a declared, well-formed sha256, and vice versa."""
    for name in names:
        if name.lower().endswith(_PICKLE_SUFFIXES):
            raise _fail(f"file {name} is a pickle-based format; only safetensors weights are accepted",
                        "unsafe_file_type")
        if not (name == CONFIG_FILE or name.endswith(".safetensors") or name in _DOC_FILES):
            raise _fail(f"file {name} is not an allowed adapter file (adapter_config.json, *.safetensors, README.md)",
                        "unsafe_file_type")
    if CONFIG_FILE not in names:
        raise _fail(f"{CONFIG_FILE} is missing", "missing_config")
    if WEIGHTS_FILE not in names:
        raise _fail(f"{WEIGHTS_FILE} is missing", "missing_file")
    for name, digest in declared.items():
        if not isinstance(digest, str) or not _SHA_RE.match(digest):
            raise _fail(f"sha256 for {name} must be 64 lowercase hex digits", "invalid_sha256")
    undeclared = sorted(set(names) - set(declared))
    if undeclared:
        raise _fail(f"no sha256 given for {undeclared}", "sha256_missing")
    absent = sorted(set(declared) - set(names))
    if absent:
        raise _fail(f"files {absent} have a sha256 but are not in the source", "missing_file")


def _parse_config(path: Path) -> PeftAdapterConfig:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _fail(f"{CONFIG_FILE} is malformed JSON: {e}", "bad_config") from e
    if not isinstance(raw, dict):
        raise _fail(f"{CONFIG_FILE} must be a JSON object", "bad_config")
    try:
        cfg = PeftAdapterConfig.model_validate(raw)
    except ValidationError as e:
        errs = "; ".join(f"field {'.'.join(map(str, err['loc']))!r}: {err['msg']}" for err in e.errors())
        raise _fail(f"{CONFIG_FILE} has wrong field types: {errs}", "bad_config") from e
    if cfg.peft_type != "LORA":
        raise _fail(f"{CONFIG_FILE} peft_type is {cfg.peft_type!r}; only LORA is supported", "bad_config")
    if cfg.r <= 0 or cfg.lora_alpha <= 0:
        raise _fail(f"{CONFIG_FILE} r and lora_alpha must be positive", "bad_config")
    for field, patterns in (("rank_pattern", cfg.rank_pattern), ("alpha_pattern", cfg.alpha_pattern)):
        bad_values = {k: v for k, v in patterns.items() if v <= 0}
        if bad_values:
            raise _fail(f"{CONFIG_FILE} {field} values must be positive, got {bad_values}", "bad_config")
    unsupported = [k for k, bad in (("use_dora", cfg.use_dora), ("modules_to_save", bool(cfg.modules_to_save)),
                                    ("bias", cfg.bias != "none")) if bad]
    if unsupported:
        raise _fail(f"{CONFIG_FILE} uses features the engine does not serve: {unsupported}", "bad_config")
    return cfg


def module_paths(spec: BaseModelSpec) -> dict[str, str]:
    """-> {"model.layers.3.self_attn.q_proj": "q_proj", ...}: every LoRA-able linear of the base model, named
    as in the model's named_modules(), which is what PEFT matches target_modules and patterns against."""
    return {f"model.layers.{layer}.{shape.block}.{module}": module
            for layer in range(spec.num_hidden_layers) for module, shape in spec.modules.items()}


def _compile(pattern: str, what: str) -> regex.Pattern:
    if len(pattern) > _MAX_PATTERN_CHARS:
        raise _fail(f"{what} is longer than {_MAX_PATTERN_CHARS} characters", "bad_config")
    try:
        re.compile(pattern)  # PEFT and the engine use `re`: what it cannot compile, they cannot serve
        return regex.compile(pattern)
    except (re.error, regex.error) as e:
        raise _fail(f"{what} {pattern!r} is not a valid regular expression: {e}", "bad_config") from e


def _matches(match_fn, text: str, what: str) -> bool:
    try:
        return match_fn(text, timeout=_MATCH_TIMEOUT_S) is not None
    except TimeoutError as e:
        raise _fail(f"{what} takes too long to match module names (catastrophic backtracking?)", "bad_config") from e


def targeted_modules(target_modules: list[str] | str, spec: BaseModelSpec) -> list[str]:
    """-> the module paths PEFT would wrap. A string is a regex full-matched against each module path; a list
    names modules exactly or by dotted suffix ("q_proj", "self_attn.q_proj")."""
    paths = module_paths(spec)
    if isinstance(target_modules, str):
        what = f"target_modules regex {target_modules!r}"
        pattern = _compile(target_modules, what)
        hit = [p for p in paths if _matches(pattern.fullmatch, p, what)]
        if not hit:
            raise _fail(f"unknown target module: target_modules regex {target_modules!r} matches no module of "
                        f"{spec.name} (module names look like {next(iter(paths))!r})", "unknown_target_module")
        return hit
    unknown = sorted({t for t in target_modules if t.split(".")[-1] not in spec.modules})
    if unknown or not target_modules:
        raise _fail(f"unknown target module(s) {unknown or target_modules} for {spec.name}; "
                    f"known: {sorted(spec.modules)}", "unknown_target_module")
    hits = {t: [p for p in paths if p == t or p.endswith("." + t)] for t in target_modules}
    unmatched = sorted(t for t, h in hits.items() if not h)
    if unmatched:
        raise _fail(f"unknown target module(s) {unmatched}: they match no module of {spec.name}",
                    "unknown_target_module")
    return [p for p in paths if any(p in h for h in hits.values())]


def module_ranks(cfg: PeftAdapterConfig, targets: list[str]) -> dict[str, int]:
    """-> {module path: rank} for the targeted modules: rank_pattern's first key matching the path by PEFT's
    rule (the key matches a dotted suffix of the path), else r. Mirrors engine_ext.lora_adapter._pattern_value."""
    for field, patterns in (("rank_pattern", cfg.rank_pattern), ("alpha_pattern", cfg.alpha_pattern)):
        for key in patterns:
            _compile(key, f"{field} key")
    keyed = [(_compile(rf"(.*\.)?({key})$", f"rank_pattern key {key!r}"), key, r)
             for key, r in cfg.rank_pattern.items()]
    return {path: next((r for pat, key, r in keyed if _matches(pat.match, path, f"rank_pattern key {key!r}")), cfg.r)
            for path in targets}


def _check_tensors(tensors: dict[str, TensorInfo], file: str, cfg: PeftAdapterConfig, ranks: dict[str, int],
                   spec: BaseModelSpec) -> set[str]:
    """-> dtypes seen. Each tensor must be a LoRA factor of a targeted module (a key of `ranks`) with the exact
    shape for that module's rank."""
    seen: set[tuple[int, str, str]] = set()
    for name, info in tensors.items():
        m = _TENSOR_RE.match(name)
        if not m:
            raise _fail(f"unexpected tensor {name!r} in {file} (not a LoRA factor of a decoder-layer linear)",
                        "tensor_mismatch")
        layer, block, module, factor = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        shape = spec.modules.get(module)
        if shape is None or shape.block != block:
            raise _fail(f"tensor {name!r} targets {block}.{module}, not a LoRA-able module of {spec.name}",
                        "tensor_mismatch")
        if layer >= spec.num_hidden_layers:
            raise _fail(f"tensor {name!r}: layer {layer} >= the base model's {spec.num_hidden_layers} layers",
                        "tensor_mismatch")
        path = f"model.layers.{layer}.{block}.{module}"
        rank = ranks.get(path)
        if rank is None:
            raise _fail(f"tensor {name!r} targets {path}, not among target_modules {cfg.target_modules}",
                        "tensor_mismatch")
        # lora_A: [r, in_features]; lora_B: [out_features, r], r being this module's rank (rank_pattern or r)
        want = [rank, shape.in_features] if factor == "A" else [shape.out_features, rank]
        if info.shape != want:
            raise _fail(f"tensor {name!r} has shape {info.shape}, expected {want} for {spec.name}", "shape_mismatch")
        if info.dtype not in _FLOAT_DTYPES:
            raise _fail(f"tensor {name!r} has dtype {info.dtype}; expected one of {sorted(_FLOAT_DTYPES)}",
                        "dtype_mismatch")
        seen.add((layer, module, factor))
    unpaired = sorted(f"layers.{l}.{mod}.lora_{f}" for l, mod, f in seen if (l, mod, "B" if f == "A" else "A") not in seen)
    if unpaired:
        raise _fail(f"LoRA factors without their partner in {file}: {unpaired[:4]}", "tensor_mismatch")
    return {t.dtype for t in tensors.values()}


def _check_finite(path: Path) -> None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except SafetensorError as e:  # whatever the header checks missed is still the file's fault, not ours
        raise _fail(f"malformed safetensors file {path.name}: {e}", "bad_safetensors") from e
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise _fail(f"tensor {name!r} in {path.name} contains NaN or Inf", "non_finite")


def validate_adapter(files: dict[str, Path], declared_sha256: dict[str, str], spec: BaseModelSpec,
                     max_rank: int, max_header_bytes: int) -> ValidatedAdapter:
    check_file_set(sorted(files), declared_sha256)
    entries: dict[str, FileEntry] = {}
    for name, path in sorted(files.items()):
        actual = sha256_file(path)
        if actual != declared_sha256[name]:
            raise _fail(f"sha256 mismatch for {name}: declared {declared_sha256[name]}, actual {actual}",
                        "sha256_mismatch")
        entries[name] = FileEntry(sha256=actual, size=path.stat().st_size)
    cfg = _parse_config(files[CONFIG_FILE])
    if cfg.base_model_name_or_path and not spec.accepts_base_name(cfg.base_model_name_or_path):
        raise _fail(f"base model mismatch: adapter was trained on {cfg.base_model_name_or_path!r}, "
                    f"registered for {spec.name!r}", "base_model_mismatch")
    ranks = module_ranks(cfg, targeted_modules(cfg.target_modules, spec))
    rank = max(ranks.values())  # the engine sizes its LoRA slots by the largest module rank
    if rank > max_rank:
        raise _fail(f"rank {rank} is too high: the maximum is {max_rank}", "rank_too_high")
    dtypes: set[str] = set()
    safetensors = [n for n in sorted(files) if n.endswith(".safetensors")]
    for name in safetensors:
        dtypes |= _check_tensors(read_header(files[name], max_header_bytes), name, cfg, ranks, spec)
    if not dtypes:
        raise _fail(f"{WEIGHTS_FILE} holds no LoRA tensors", "tensor_mismatch")
    if len(dtypes) > 1:
        raise _fail(f"mixed tensor dtypes {sorted(dtypes)}; one dtype per adapter", "dtype_mismatch")
    for name in safetensors:
        _check_finite(files[name])
    paths = module_paths(spec)
    return ValidatedAdapter(rank=rank, alpha=float(cfg.lora_alpha), target_modules=sorted({paths[p] for p in ranks}),
                            dtype=dtypes.pop(), files=entries)
