"""The model directory's tokenizer, loaded without resolving the model's transformers config where that
changes nothing.

`AutoTokenizer` first builds the model's transformers config to pick a class, which imports that model's
modelling stack (seconds of a replica's start-up on a CPU, far more on a busy one, for a model this engine
runs itself). When `tokenizer_config.json` names a generic class (no model-specific behaviour) and the model
type is one whose generic declaration `AutoTokenizer` honours as is, the class is loaded directly: the
same object `AutoTokenizer` returns (tests/engine_ext/test_tokenizer_loading.py checks it against
`AutoTokenizer` for each such type). Anything else goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
import os

__all__ = ["load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Classes that carry no model-specific behaviour (transformers 5 names the second an alias of the first).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types for which `AutoTokenizer` returns the generic class a tokenizer_config.json names (Qwen2, for
# one, is not: transformers overrides its hub declaration with its own class).
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "mistral")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def loads_directly(model_dir: str) -> bool:
    """True when the tokenizer's generic class can be loaded without `AutoTokenizer`'s config resolution."""
    tok = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    model = _read_json(os.path.join(model_dir, "config.json"))
    return (os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
            and tok.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in tok
            and model.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES)


def load_tokenizer(model_dir: str):
    """The model's tokenizer, or None for a directory without tokenizer files."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return None
    if loads_directly(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
