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

from pydantic import BaseModel

from registry.base_model import BaseModelSpec
from registry.errors import RegistryValidationError
from registry.records import FileEntry
from registry.safetensors_header import TensorInfo, read_header

__all__ = ["ValidatedAdapter", "validate_adapter", "sha256_file", "check_file_set", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DOC_FILES = frozenset({"README.md"})
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")


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


def _parse_config(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _fail(f"{CONFIG_FILE} is malformed JSON: {e}", "bad_config") from e
    if not isinstance(raw, dict):
        raise _fail(f"{CONFIG_FILE} must be a JSON object", "bad_config")
    return raw


def _check_tensors(tensors: dict[str, TensorInfo], file: str, plan, spec: BaseModelSpec) -> set[str]:
    """-> dtypes seen. The tensors must be exactly the LoRA factors of the modules the config targets."""
    from engine_ext.lora_config import LoraConfigError, match_tensors

    try:
        match_tensors(plan, {n: t.shape for n, t in tensors.items()},
                      {m: (s.in_features, s.out_features) for m, s in spec.modules.items()})
    except LoraConfigError as e:
        raise _fail(f"{e.message} (in {file})", e.code) from e
    for name, info in tensors.items():
        if info.dtype not in _FLOAT_DTYPES:
            raise _fail(f"tensor {name!r} has dtype {info.dtype}; expected one of {sorted(_FLOAT_DTYPES)}",
                        "dtype_mismatch")
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
    # The engine's own rules (one place): PEFT's targets, ranks and scales, or a refusal naming the field.
    from engine_ext.lora_config import LoraConfigError, plan_adapter

    cfg = _parse_config(files[CONFIG_FILE])
    base_name = cfg.get("base_model_name_or_path")
    if isinstance(base_name, str) and base_name and not spec.accepts_base_name(base_name):
        raise _fail(f"base model mismatch: adapter was trained on {base_name!r}, registered for {spec.name!r}",
                    "base_model_mismatch")
    try:
        plan = plan_adapter(cfg, spec.num_hidden_layers)
    except LoraConfigError as e:
        raise _fail(f"{CONFIG_FILE}: {e.message}", e.code) from e
    if plan.max_rank > max_rank:
        raise _fail(f"rank {plan.max_rank} is too high: the maximum is {max_rank}", "rank_too_high")
    safetensors = [n for n in sorted(files) if n.endswith(".safetensors")]
    if safetensors != [WEIGHTS_FILE]:
        raise _fail(f"one weights file, {WEIGHTS_FILE}, is served; found {safetensors}", "unsafe_file_type")
    dtypes = _check_tensors(read_header(files[WEIGHTS_FILE], max_header_bytes), WEIGHTS_FILE, plan, spec)
    if len(dtypes) > 1:
        raise _fail(f"mixed tensor dtypes {sorted(dtypes)}; one dtype per adapter", "dtype_mismatch")
    _check_finite(files[WEIGHTS_FILE])
    return ValidatedAdapter(rank=plan.max_rank, alpha=plan.lora_alpha, target_modules=plan.target_modules,
                            dtype=dtypes.pop(), files=entries)
