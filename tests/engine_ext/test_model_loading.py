"""Model directories: config formats, sharded weights, tokenizers, and clear errors for what is missing."""

import json
import os
import shutil

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from engine_ext.model_config import load_model_spec
from tiny_models import build_model, hf_oracle, rewrite_config

PROMPTS = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_model("llama", str(tmp_path_factory.mktemp("llama") / "m"))


def greedy(model_dir, n=16):
    engine = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64))
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_llama3_rope_read_from_legacy_rope_scaling(llama, tmp_path):
    """Older configs: rope_theta at top level and `rope_scaling`; transformers 5 writes `rope_parameters`."""
    legacy = str(tmp_path / "legacy")
    shutil.copytree(llama, legacy)
    with open(os.path.join(llama, "config.json")) as f:
        params = dict(json.load(f)["rope_parameters"])
    theta = params.pop("rope_theta")
    rewrite_config(legacy, rope_parameters=None, rope_theta=theta, rope_scaling=params)
    spec = load_model_spec(legacy)
    assert spec.rope.rope_type == "llama3" and spec.rope.factor == 8.0 and spec.rope.theta == theta
    assert load_model_spec(llama).rope == spec.rope
    oracle = hf_oracle(llama, {})
    assert greedy(legacy) == [oracle(p, None, 16)[0] for p in PROMPTS]


def test_llama3_scaling_changes_outputs(llama, tmp_path):
    """The rope scaling is really applied: dropping it changes the logits, and both match transformers."""
    plain = str(tmp_path / "plain")
    shutil.copytree(llama, plain)
    rewrite_config(plain, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert load_model_spec(plain).rope.rope_type == "default"
    oracle = hf_oracle(plain, {})
    assert greedy(plain) == [oracle(p, None, 16)[0] for p in PROMPTS]
    params = SamplingParams(max_tokens=8, ignore_eos=True, return_logits=True)
    logits = [LLMEngine(EngineConfig(model=m, num_kv_blocks=64)).generate(
        prompt_token_ids=[PROMPTS[0]], sampling_params=params)[0].logits for m in (llama, plain)]
    assert (logits[0] - logits[1]).abs().max() > 1e-3


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    one = build_model("qwen2", str(tmp_path / "one"))
    model = AutoModelForCausalLM.from_pretrained(one)
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB", safe_serialization=True)
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    assert greedy(str(tmp_path / "sharded")) == greedy(one)


def test_unsupported_architecture_named(llama, tmp_path):
    other = str(tmp_path / "gpt2ish")
    shutil.copytree(llama, other)
    rewrite_config(other, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=other))


@pytest.mark.parametrize("remove,match", [("config.json", "missing config.json"),
                                          ("model.safetensors", "no \\*.safetensors")])
def test_missing_files_named(llama, tmp_path, remove, match):
    broken = str(tmp_path / "broken")
    shutil.copytree(llama, broken)
    os.remove(os.path.join(broken, remove))
    with pytest.raises(ModelLoadError, match=match):
        LLMEngine(EngineConfig(model=broken))


def test_pickled_model_weights_refused(llama, tmp_path):
    broken = str(tmp_path / "pickled")
    shutil.copytree(llama, broken)
    os.remove(os.path.join(broken, "model.safetensors"))
    torch.save({"x": torch.zeros(1)}, os.path.join(broken, "pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match="pickled weights"):
        LLMEngine(EngineConfig(model=broken))


def test_missing_tensor_named(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = str(tmp_path / "missing-tensor")
    shutil.copytree(llama, broken)
    path = os.path.join(broken, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        LLMEngine(EngineConfig(model=broken))


def test_text_prompts_through_the_tokenizer(llama, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(ord("a") + i): i for i in range(26)} | {" ": 26, "<unk>": 27, "</s>": 28}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    withtok = str(tmp_path / "withtok")
    shutil.copytree(llama, withtok)
    fast.save_pretrained(withtok)
    engine = LLMEngine(EngineConfig(model=withtok, num_kv_blocks=64))
    out = engine.generate(prompts=["hello world"], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))[0]
    ids = fast("hello world")["input_ids"]
    assert out.prompt_token_ids == ids
    assert out.text == fast.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("bad,match", [
    (dict(cuda_graphs=True), "cuda_graphs needs a CUDA device"),
    (dict(device="cuda", cuda_graphs=True, lora_backend="triton", layer_ops="triton"),
     "cuda_graphs needs a CUDA device and attn_backend='triton'"),
    (dict(lora_backend="cuda"), r"unknown lora_backend 'cuda'; choose one of \['torch', 'gather', 'triton'\]"),
    (dict(attn_backend="flash"), "unknown attn_backend 'flash'"),
    (dict(layer_ops="fused"), r"unknown layer_ops 'fused'; choose one of \['torch', 'triton'\]"),
    (dict(kernels={"attn_warps": 3}), "attn_warps must be a power of two"),
    (dict(max_graph_tokens=0), "max_graph_tokens must be >= 1"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras must be >= max_loras"),
])
def test_engine_options_are_validated(llama, bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=llama, **bad)


def test_cpu_kv_default_holds_what_max_num_seqs_can_use_and_no_more(llama):
    from engine_ext.block_manager import blocks_for

    engine = LLMEngine(EngineConfig(model=llama, max_num_seqs=3, max_model_len=40))
    per_seq = blocks_for(engine.runner.max_positions, engine.config.block_size)
    assert engine.runner.num_blocks == 3 * per_seq  # far below the 0.5 GiB budget for this model
    outs = engine.generate(prompt_token_ids=[[1, 2, 3]] * 5, sampling_params=SamplingParams(max_tokens=36,
                                                                                              ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [36] * 5  # full-length sequences, 3 at a time: none short of room
    # an explicit budget is taken as given
    assert LLMEngine(EngineConfig(model=llama, max_num_seqs=3, max_model_len=40,
                                  kv_cache_memory_gb=0.01)).runner.num_blocks > 3 * per_seq
