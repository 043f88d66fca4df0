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
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from registry.base_model import BaseModelSpec
from registry.errors import RegistryValidationError
from registry.records import FileEntry
from registry.safetensors_header import TensorInfo, read_header

__all__ = ["ValidatedAdapter", "PeftAdapterConfig", "validate_adapter", "sha256_file", "check_file_set",
           "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DOC_FILES = frozenset({"README.md"})
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# PEFT's saved key for a LoRA factor of a decoder-layer linear (adapter name already stripped).
_TENSOR_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z_]+)\.lora_(A|B)\.weight$")


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
    rank_pattern: dict[str, Any] = {}
    alpha_pattern: dict[str, Any] = {}


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
    unsupported = [k for k, bad in (("use_dora", cfg.use_dora), ("modules_to_save", bool(cfg.modules_to_save)),
                                    ("rank_pattern", bool(cfg.rank_pattern)), ("alpha_pattern", bool(cfg.alpha_pattern)),
                                    ("bias", cfg.bias != "none")) if bad]
    if unsupported:
        raise _fail(f"{CONFIG_FILE} uses features the engine does not serve: {unsupported}", "bad_config")
    return cfg


def _check_tensors(tensors: dict[str, TensorInfo], file: str, cfg: PeftAdapterConfig, targets: list[str],
                   spec: BaseModelSpec) -> set[str]:
    """-> dtypes seen. Each tensor must be a LoRA factor of a targeted module with the exact shape."""
    seen: set[tuple[int, str, str]] = set()
    for name, info in tensors.items():
        m = _TENSOR_RE.match(name)
        if not m:
            raise _fail(f"unexpected tensor {name!r} in {file} (not a LoRA factor of a decoder-layer linear)",
                        "tensor_mismatch")
        layer, block, module, factor = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        shape = spec.modules.get(module)
        if module not in targets or shape is None or shape.block != block:
            raise _fail(f"tensor {name!r} targets {block}.{module}, not among target_modules {targets}",
                        "tensor_mismatch")
        if layer >= spec.num_hidden_layers:
            raise _fail(f"tensor {name!r}: layer {layer} >= the base model's {spec.num_hidden_layers} layers",
                        "tensor_mismatch")
        # lora_A: [r, in_features]; lora_B: [out_features, r]
        want = [cfg.r, shape.in_features] if factor == "A" else [shape.out_features, cfg.r]
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
    from safetensors.torch import load_file

    for name, t in load_file(str(path)).items():
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
    if cfg.r > max_rank:
        raise _fail(f"rank {cfg.r} is too high: the maximum is {max_rank}", "rank_too_high")
    targets = [cfg.target_modules] if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    unknown = sorted(set(targets) - set(spec.modules))
    if unknown or not targets:
        raise _fail(f"unknown target module(s) {unknown or targets} for {spec.name}; known: {sorted(spec.modules)}",
                    "unknown_target_module")
    dtypes: set[str] = set()
    safetensors = [n for n in sorted(files) if n.endswith(".safetensors")]
    for name in safetensors:
        dtypes |= _check_tensors(read_header(files[name], max_header_bytes), name, cfg, targets, spec)
    if not dtypes:
        raise _fail(f"{WEIGHTS_FILE} holds no LoRA tensors", "tensor_mismatch")
    if len(dtypes) > 1:
        raise _fail(f"mixed tensor dtypes {sorted(dtypes)}; one dtype per adapter", "dtype_mismatch")
    for name in safetensors:
        _check_finite(files[name])
    return ValidatedAdapter(rank=cfg.r, alpha=float(cfg.lora_alpha), target_modules=sorted(targets),
                            dtype=dtypes.pop(), files=entries)
