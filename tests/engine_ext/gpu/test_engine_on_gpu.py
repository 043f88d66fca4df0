"""The whole engine on the GPU with the Triton kernels and CUDA graphs: token-for-token what the
plain-torch engine produces, for plain multi-LoRA and speculative decoding, across adapter swaps."""

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tiny_models import build_adapter, build_model

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {
    "near-r8": dict(r=8, target_modules=ALL, std=0.03),
    "mid-r16": dict(r=16, target_modules=("q_proj", "v_proj", "down_proj"), std=0.08),
    "far-r64": dict(r=64, alpha=64, target_modules=ALL, std=0.08),
    "near-r32": dict(r=32, target_modules=("q_proj", "k_proj", "o_proj"), std=0.02),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3, 3], [50, 60, 70], [5, 4, 3, 2, 1, 9]]
NAMES = ["near-r8", None, "mid-r16", "far-r64", "near-r32", "mid-r16"]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-llama")
    model = build_model("llama", str(root / "m"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    ref = _engine(model, adapters, None, device="cuda")  # the plain-torch kernels, eager
    expected = [o.token_ids for o in ref.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS,
                                                  adapter_names=NAMES)]
    return model, adapters, expected


def _engine(model, adapters, spec, **kw):
    kw.setdefault("num_kv_blocks", 256)
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_loras=2, block_size=4, max_model_len=128,
                                    speculative=spec, **kw))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


FAST = dict(device="cuda", lora_backend="triton", attn_backend="triton", layer_ops="triton", cuda_graphs=True,
            max_graph_tokens=48)


@pytest.mark.parametrize("spec", [None, SpecConfig(num_draft_tokens=3, gate=False), SpecConfig(num_draft_tokens=2)],
                         ids=["plain", "spec-k3", "spec-k2-gated"])
def test_graphs_and_kernels_reproduce_the_eager_engine(setup, spec):
    model, adapters, expected = setup
    engine = _engine(model, adapters, spec, **FAST)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    graphs = engine.runner.graphs
    # 4 adapters through 2 slots: the mix changed many times, against graphs captured once.
    assert sum(c.loads for c in engine.adapters.counters.values()) > len(ADAPTERS) - 1
    assert graphs.capture_seconds is not None and len(graphs.graphs) == 2 * len(graphs.buckets)


def test_kernels_without_graphs_reproduce_the_eager_engine(setup):
    model, adapters, expected = setup
    engine = _engine(model, adapters, None, device="cuda", lora_backend="triton", attn_backend="triton",
                     layer_ops="triton")
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected


def test_cuda_graphs_need_the_triton_attention(setup):
    model, _, _ = setup
    with pytest.raises(ValueError, match="cuda_graphs needs"):
        EngineConfig(model=model, device="cuda", cuda_graphs=True)
    assert torch.cuda.is_available()
