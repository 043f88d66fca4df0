"""The tokenizer a model directory gets (engine_ext/tokenizer.py): for the model types and generic classes
loaded directly, the same class and the same behaviour as `AutoTokenizer`, without importing the model's
transformers config (seconds of every replica's start-up); anything else through `AutoTokenizer`."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_ext.tokenizer import (GENERIC_TOKENIZER_CLASSES, GENERIC_TOKENIZER_MODEL_TYPES, load_tokenizer,
                                  loads_directly)

CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "Write a function that adds two numbers."}]
TEXTS = ["def add(a, b):\n    return a + b", "  spaces, ünïcode and <|user|> a special token </s>", ""]


def model_dir_as(src: str, dst: Path, model_type: str, tokenizer_class: str) -> str:
    """The demo model's config and tokenizer files, relabelled as `model_type` naming `tokenizer_class`."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / name, dst / name)
    for name, field, value in (("config.json", "model_type", model_type),
                               ("tokenizer_config.json", "tokenizer_class", tokenizer_class)):
        data = json.loads((dst / name).read_text())
        (dst / name).write_text(json.dumps(data | {field: value}))
    return str(dst)


@pytest.mark.parametrize("tokenizer_class", GENERIC_TOKENIZER_CLASSES)
@pytest.mark.parametrize("model_type", GENERIC_TOKENIZER_MODEL_TYPES)
def test_direct_load_is_what_auto_tokenizer_returns(demo_paths, tmp_path, model_type, tokenizer_class):
    from transformers import AutoTokenizer

    d = model_dir_as(demo_paths["model"], tmp_path / "m", model_type, tokenizer_class)
    assert loads_directly(d)
    ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
    assert type(ours) is type(auto)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (auto.eos_token_id, auto.bos_token_id,
                                                                          auto.all_special_ids)
    assert ours.get_vocab() == auto.get_vocab()
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == auto(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    chat = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat == auto.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("model_type, tokenizer_class, auto_map", [
    ("qwen2", "PreTrainedTokenizerFast", False),  # transformers overrides Qwen2's hub class
    ("llama", "LlamaTokenizer", False),  # a model-specific class
    ("llama", "PreTrainedTokenizerFast", True),  # remote code decides
])
def test_everything_else_goes_through_auto_tokenizer(demo_paths, tmp_path, model_type, tokenizer_class, auto_map):
    d = model_dir_as(demo_paths["model"], tmp_path / "m", model_type, tokenizer_class)
    if auto_map:
        cfg = json.loads((Path(d) / "tokenizer_config.json").read_text())
        (Path(d) / "tokenizer_config.json").write_text(json.dumps(cfg | {"auto_map": {"AutoTokenizer": ["x.X", None]}}))
    assert not loads_directly(d)


def test_building_the_demo_engine_imports_no_transformers_model_config(demo_paths):
    # In a fresh process: the model's transformers config module (and the modelling stack it pulls in) is what
    # made a replica's tokenizer take seconds to load.
    code = ("import sys; from engine_ext import EngineConfig, LLMEngine; "
            f"e = LLMEngine(EngineConfig(model={demo_paths['model']!r})); assert e.tokenizer is not None; "
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.llama')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
