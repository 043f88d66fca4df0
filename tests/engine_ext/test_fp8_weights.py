"""FP8 base weights (EngineConfig.quantization="fp8"): e4m3 with one scale per output channel, quantized as the model
loads or read from a checkpoint stored so in the vLLM / transformers layout, multiplied on the CPU by the plain-torch
reference; schemes the engine cannot serve exactly are refused by name at start-up, and so is a GPU without FP8.

Speculative decoding on the FP8 engine equals plain decoding: test_speculative_greedy.py runs on it (its `backend`
fixture); each SmolLM2 adapter keeps its behaviour on it: tests/demo/test_smollm2_behaviour.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ext import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from engine_ext.quantization import (FP8_DTYPE, LINEAR_WEIGHT, Fp8Linear, check_fp8_device, fp8_linear, fp8_values,
                                     quantize_fp8)
from tiny_models import build_model

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: q/k/v bias after the scaled product
def model(request, tmp_path_factory, one_torch_thread):
    return build_model(request.param, str(tmp_path_factory.mktemp(request.param) / "m"))


def write_checkpoint(src: str, dst: str, convert, quantization_config: dict | None) -> str:
    """A copy of the model directory `src` with each projection weight replaced by convert(name, W) -> {name: tensor}
    and `quantization_config` in its config.json (None: left out)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = {}
    for name, w in load_file(path).items():
        tensors |= convert(name, w) if LINEAR_WEIGHT.match(name) else {name: w}
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def per_channel(name: str, w: torch.Tensor) -> dict:
    """The layout vLLM's fp8 method and compressed-tensors' channel strategy write: e4m3 weight, float32 weight_scale
    [out, 1], scale = absmax of the row / 448 (written here without the engine's code)."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    return {name: (w.float() / scale).to(torch.float8_e4m3fn), name + "_scale": scale}


def per_tensor(name: str, w: torch.Tensor) -> dict:
    scale = w.float().abs().max() / 448.0
    return {name: (w.float() / scale).to(torch.float8_e4m3fn), name + "_scale": scale.reshape(())}


def engine(model_dir: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, block_size=4, **kw))


def fp8_layers(e: LLMEngine) -> list[Fp8Linear]:
    return [w for layer in e.runner.model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]


def generate(e: LLMEngine):
    return e.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)


# ------------------------------------------------------------------ the format
def test_quantize_round_trip_per_output_channel():
    torch.manual_seed(0)
    w = torch.randn(48, 40) * torch.logspace(-3, 1, 48)[:, None]  # rows four decades apart
    w[5] = 0.0
    w8, scale = quantize_fp8(w.to(torch.bfloat16))
    assert w8.dtype == FP8_DTYPE and w8.shape == (48, 40) and scale.dtype == torch.float32 and scale.shape == (48,)
    back = fp8_values(w8) * scale[:, None]
    wb = w.to(torch.bfloat16).float()
    # each row's absmax lands on 448 exactly; e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 for
    # normal values, an absolute one of at most 2**-10 * scale for subnormal ones
    assert torch.equal(fp8_values(w8).abs().amax(1)[scale != 1], torch.full((47,), 448.0))
    assert ((back - wb).abs() <= torch.maximum(wb.abs() * 2**-4, scale[:, None] * 2**-10)).all()
    assert torch.equal(back[5], torch.zeros(40)) and scale[5] == 1.0
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8(torch.tensor([[1.0, float("inf")]]))


def test_fp8_bytes_widen_exactly_to_every_float_dtype():
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8).view(FP8_DTYPE)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(fp8_values(finite, dtype), finite.to(dtype)), dtype


def test_fp8_linear_is_the_product_with_the_scaled_weights():
    torch.manual_seed(1)
    w, x, bias = torch.randn(24, 16), torch.randn(5, 16), torch.randn(24)
    w8, scale = quantize_fp8(w)
    y = fp8_linear(x, w8, scale, bias)
    torch.testing.assert_close(y, x @ (fp8_values(w8) * scale[:, None]).T + bias, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, (x @ fp8_values(w8).T) * scale + bias)  # the contract, as written


# ------------------------------------------------------------------ the engine
def test_fp8_engine_computes_the_model_its_fp8_weights_describe(model, tmp_path):
    """Against a dense engine on a checkpoint of the dequantized weights: the same tokens and logits within float32
    rounding (the scale comes after the product), so scales follow their rows through the fused q/k/v and gate/up."""
    fp8 = engine(model, quantization="fp8")
    def dequantize(name, w):
        w8, scale = quantize_fp8(w)
        return {name: fp8_values(w8) * scale[:, None]}
    dequantized = write_checkpoint(model, str(tmp_path / "deq"), dequantize, None)
    dense = engine(dequantized)
    for a, b in zip(generate(fp8), generate(dense)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    full = engine(model)
    assert any(a.token_ids != b.token_ids or not torch.equal(a.logits, b.logits)
               for a, b in zip(generate(fp8), generate(full)))  # and it is not the full-precision model


def test_fp8_linear_weights_take_a_quarter_of_float32s_bytes(model):
    def linear_bytes(e):
        weights = [w for layer in e.runner.model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(w.numel() * w.element_size() for w in (w if isinstance(w, torch.Tensor) else w.weight
                                                           for w in weights))
    fp8, dense = engine(model, quantization="fp8"), engine(model)
    assert linear_bytes(fp8) * 4 == linear_bytes(dense)
    assert all(w.weight.dtype == FP8_DTYPE and w.scale.shape == (w.weight.shape[0],) for w in fp8_layers(fp8))
    m = fp8.runner.model  # what stays in the model's dtype
    assert m.embed.dtype == m.lm_head.dtype == m.layers[0].input_norm.dtype == torch.float32
    assert fp8.runner.kv_caches[0][0].dtype == torch.float32


@pytest.mark.parametrize("layout", [per_channel, per_tensor])
def test_a_prequantized_checkpoint_loads_to_what_quantizing_at_load_gives(model, tmp_path, layout):
    stored = write_checkpoint(model, str(tmp_path / "fp8"), layout, FP8_CONFIG)
    loaded, at_load = engine(stored, quantization="fp8"), engine(model, quantization="fp8")
    if layout is per_channel:  # the same bytes and scales, so the same tokens
        for a, b in zip(fp8_layers(loaded), fp8_layers(at_load)):
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            assert torch.equal(a.scale, b.scale)
        assert [o.token_ids for o in generate(loaded)] == [o.token_ids for o in generate(at_load)]
    else:  # one scale a tensor, repeated for every channel of it (fused q/k/v: three values)
        qkv = loaded.runner.model.layers[0].qkv.scale
        spec = loaded.spec
        assert len(set(qkv[: spec.q_size].tolist())) == 1 and len(set(qkv.tolist())) == 3
        assert all(o.finish_reason == "length" for o in generate(loaded))


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("change, message", [
    ({"weight_block_size": [128, 128]}, "block-wise scales (weight_block_size [128, 128])"),
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors' is not supported"),
    ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported"),
    ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme is not supported"),
    ({"ignored_layers": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignored_layers names decoder projections"),
    ({"weight_dtype": "int8"}, "unknown field(s) ['weight_dtype']"),
])
def test_unsupported_quantization_configs_are_refused_by_name(model, tmp_path, change, message):
    stored = write_checkpoint(model, str(tmp_path / "q"), per_channel, FP8_CONFIG | change)
    with pytest.raises(ModelLoadError) as err:
        engine(stored, quantization="fp8")
    assert message in str(err.value)


def blockwise(name: str, w: torch.Tensor) -> dict:
    """Scales over 2 x 2 blocks of the weight, in a checkpoint that does not say so (no weight_block_size)."""
    scale = w.float().abs().reshape(w.shape[0] // 2, 2, w.shape[1] // 2, 2).amax((1, 3)) / 448.0
    return {name: (w.float() / scale.repeat_interleave(2, 0).repeat_interleave(2, 1)).to(FP8_DTYPE),
            name + "_scale": scale}


@pytest.mark.parametrize("convert, message", [
    (lambda n, w: {n: w.to(torch.float8_e5m2), n + "_scale": torch.ones(w.shape[0])}, "torch.float8_e5m2"),
    (lambda n, w: {n: w.mul(100).to(torch.int8), n + "_scale": torch.ones(w.shape[0])}, "torch.int8"),
    (blockwise, "per-channel or per-tensor scales are supported"),
    (lambda n, w: {n: w.to(FP8_DTYPE)}, "weight_scale' is missing"),
    (lambda n, w: {n: torch.full_like(w, float("nan")).to(FP8_DTYPE), n + "_scale": torch.ones(w.shape[0])},
     "FP8 weight holds NaN"),
])
def test_unsupported_fp8_tensors_are_refused_by_name(model, tmp_path, convert, message):
    stored = write_checkpoint(model, str(tmp_path / "q"), convert, FP8_CONFIG)
    with pytest.raises(ModelLoadError) as err:
        engine(stored, quantization="fp8")
    assert message in str(err.value)


def test_a_prequantized_checkpoint_needs_quantization_fp8(model, tmp_path):
    stored = write_checkpoint(model, str(tmp_path / "fp8"), per_channel, FP8_CONFIG)
    with pytest.raises(ModelLoadError, match="stored as fp8 .*serve it with quantization='fp8', not None"):
        engine(stored)


def test_unknown_quantization_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"unknown quantization 'int8'; choose one of \[None, 'fp8'\]"):
        EngineConfig(quantization="int8")


@pytest.mark.parametrize("capability, ok", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                            ((10, 0), True)])
def test_fp8_on_a_gpu_needs_compute_capability_8_9(capability, ok):
    if ok:
        check_fp8_device(torch.device("cuda:0"), capability)
        return
    with pytest.raises(ValueError) as err:
        check_fp8_device(torch.device("cuda:0"), capability)
    assert "needs a GPU with FP8 support (compute capability >= 8.9" in str(err.value)
    assert f"has {capability[0]}.{capability[1]}" in str(err.value)


def test_a_cpu_runs_fp8():
    check_fp8_device(torch.device("cpu"))  # no capability to read: the reference runs anywhere
