"""Suite-wide setup: the repository root on sys.path, so `tests.fixtures` imports under plain `pytest`; the
embedded models and their adapters (made ready once, then cached), which the demo's and the engine's tests
share: the toy model for fast tests, SmolLM2-135M-Instruct for tests of a real model's behaviour."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def demo_paths() -> dict:
    """{"model": dir, "adapters": {name: dir}}: built on first use into $LORASERVE_CACHE or ~/.cache/loraserve
    (about 2-3 minutes on 2 cores), then found there by every later session."""
    from demo import ensure_demo

    return ensure_demo()


@pytest.fixture(scope="session")
def smollm2_paths() -> dict:
    """{"model": dir, "adapters": {name: dir}}: the default model, fetched and converted by `scripts/setup`
    (under a minute), and its committed adapters."""
    from demo import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def demo_hf(demo_paths):
    """(tokenizer, PeftModel holding every demo adapter); `with model.disable_adapter()` is the base."""
    return _peft_with_adapters(demo_paths)


def _peft_with_adapters(paths: dict):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["model"])
    base = AutoModelForCausalLM.from_pretrained(paths["model"], torch_dtype=torch.float32).eval()
    names = list(paths["adapters"])
    model = PeftModel.from_pretrained(base, paths["adapters"][names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(paths["adapters"][name], adapter_name=name)
    return tok, model.eval()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_paths):
    """(tokenizer, PeftModel holding every SmolLM2 adapter), float32; `with model.disable_adapter()` is the base."""
    return _peft_with_adapters(smollm2_paths)
