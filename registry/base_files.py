"""Which files of a Hugging Face model directory the registry stores for a base model: the config, the
tokenizer and safetensors weights, never pickles. Replicas then fetch the base model from the blob store
(S3 on a cluster) like an adapter, hash-verified, instead of reading a volume every pod must mount."""

from __future__ import annotations

from pathlib import Path

from registry.errors import RegistryValidationError
from registry.records import FileEntry
from registry.safetensors_header import read_header
from registry.sources import FILE_NAME_PATTERN
from registry.validation import sha256_file

__all__ = ["select_base_files", "describe_files", "BASE_CONFIG_FILES"]

# Everything the engine and the tokenizer read from a model directory besides the weights.
BASE_CONFIG_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
})
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def select_base_files(model_dir: Path, max_header_bytes: int) -> dict[str, Path]:
    """-> file name -> path of the files to store: the known config/tokenizer files and every `*.safetensors`
    (each header checked). Other files (README, images) are left out; pickled weights are refused."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise RegistryValidationError(f"{model_dir} is not a directory", code="missing_file")
    picked: dict[str, Path] = {}
    for p in sorted(model_dir.iterdir()):
        if not p.is_file():
            continue
        if p.name.lower().endswith(_PICKLE_SUFFIXES):
            raise RegistryValidationError(f"{p.name} is a pickle-based format; store the base model as safetensors",
                                          code="unsafe_file_type")
        if p.name in BASE_CONFIG_FILES or p.name.endswith(".safetensors"):
            if not FILE_NAME_PATTERN.match(p.name):
                raise RegistryValidationError(f"invalid file name {p.name!r}", code="invalid_file_name")
            if p.name.endswith(".safetensors"):
                read_header(p, max_header_bytes)
            picked[p.name] = p
    if "config.json" not in picked or not any(n.endswith(".safetensors") for n in picked):
        raise RegistryValidationError(f"{model_dir} needs config.json and safetensors weights", code="missing_file")
    return picked


def describe_files(files: dict[str, Path]) -> dict[str, FileEntry]:
    return {n: FileEntry(sha256=sha256_file(p), size=p.stat().st_size) for n, p in files.items()}
