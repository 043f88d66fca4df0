"""Fixtures shared by the engine tests: the embedded demo model and adapters (built once, then cached), and the
backend a suite runs on."""
from __future__ import annotations

import pytest

from backends import BACKENDS, skip_unless_available


@pytest.fixture(scope="session")
def demo_paths() -> dict:
    """{"model": dir, "adapters": {name: dir}}: built on first use into $LORASERVE_CACHE or ~/.cache/loraserve
    (about 2-3 minutes on 2 cores), then found there by every later session."""
    from engine_ext.demo import ensure_demo

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


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> dict:
    """EngineConfig fields of one backend (backends.py): a test asking for it runs once per backend, the GPU
    ones marked `gpu` and skipped where CUDA or Triton is missing."""
    skip_unless_available(request.param)
    return dict(request.param)
