"""Suite-wide setup: the repository root on sys.path, so `tests.fixtures` imports under plain `pytest`; the
embedded demo model and adapters (built once, then cached), which the demo's and the engine's tests share."""

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
def demo_hf(demo_paths):
    """(tokenizer, PeftModel holding every demo adapter); `with model.disable_adapter()` is the base."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_paths["model"])
    base = AutoModelForCausalLM.from_pretrained(demo_paths["model"], torch_dtype=torch.float32).eval()
    names = list(demo_paths["adapters"])
    model = PeftModel.from_pretrained(base, demo_paths["adapters"][names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(demo_paths["adapters"][name], adapter_name=name)
    return tok, model.eval()
