"""Each bad adapter is refused with its own clear message, and the engine keeps serving."""

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ext import AdapterError, EngineConfig, LLMEngine, SamplingParams
from tiny_models import build_adapter, build_model

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    model = build_model("llama", str(root / "model"))
    good = build_adapter(model, str(root / "good"), seed=1, r=8)
    engine = LLMEngine(EngineConfig(model=model, max_lora_rank=16, num_kv_blocks=64))
    engine.add_adapter("good", good)
    return engine, model, good, root


def edit_tensors(path, fn):
    tensors = load_file(os.path.join(path, WEIGHTS))
    fn(tensors)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": "pt"})


def edit_config(path, **changes):
    p = os.path.join(path, "adapter_config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(p, "w") as f:
        json.dump(cfg, f)


def first_key(tensors, part):
    return next(k for k in sorted(tensors) if part in k)


def _nan(t):
    k = first_key(t, "lora_B")
    t[k] = t[k].clone()
    t[k][0, 0] = float("nan")


def _inf(t):
    k = first_key(t, "lora_A")
    t[k] = t[k].clone()
    t[k][1, 1] = float("inf")


def _shape(t):
    k = first_key(t, "lora_A")
    t[k] = torch.zeros(t[k].shape[0], t[k].shape[1] + 3)


def _name(t):
    k = first_key(t, "lora_A")
    t[k.replace("q_proj", "qq_proj")] = t.pop(k)


def _layer(t):
    k = first_key(t, "layers.0.self_attn.q_proj.lora_A")
    t[k.replace("layers.0", "layers.7")] = t.pop(k)


def _orphan(t):
    t.pop(first_key(t, "lora_B"))


CASES = {
    "pickled": (lambda p: torch.save({}, os.path.join(p, "adapter_model.bin")), "pickled weight files are refused"),
    "missing-config": (lambda p: os.remove(os.path.join(p, "adapter_config.json")), "missing adapter_config.json"),
    "malformed-config": (lambda p: open(os.path.join(p, "adapter_config.json"), "w").write("{nope"),
                         "malformed adapter_config.json"),
    "missing-weights": (lambda p: os.remove(os.path.join(p, WEIGHTS)), f"missing {WEIGHTS}"),
    "garbage-weights": (lambda p: open(os.path.join(p, WEIGHTS), "wb").write(b"\x10\x00" * 9), "unreadable"),
    "nan": (lambda p: edit_tensors(p, _nan), "NaN or Inf"),
    "inf": (lambda p: edit_tensors(p, _inf), "NaN or Inf"),
    "shape": (lambda p: edit_tensors(p, _shape), "has shape"),
    "unknown-module": (lambda p: edit_tensors(p, _name), "unexpected tensor"),
    "layer-out-of-range": (lambda p: edit_tensors(p, _layer), "layers.7.self_attn.q_proj, which the config does not target"),
    "orphan-A": (lambda p: edit_tensors(p, _orphan), "has no factors for"),
    "dora": (lambda p: edit_config(p, use_dora=True), "use_dora"),
    "unsupported-target": (lambda p: edit_config(p, target_modules=["q_proj", "lm_head"]), "lm_head"),
    "wrong-type": (lambda p: edit_config(p, r="eight"), "field 'r' must be a positive int"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapter_refused_and_engine_keeps_serving(env, case, tmp_path):
    engine, model, good, _ = env
    broken = str(tmp_path / case)
    shutil.copytree(good, broken)
    mutate, message = CASES[case]
    mutate(broken)
    with pytest.raises(AdapterError, match=message) as err:
        engine.add_adapter(case, broken)
    assert repr(case) in str(err.value)  # the message names the adapter
    assert not engine.has_adapter(case)
    out = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                          adapter_names=["good"])[0]
    assert len(out.token_ids) == 4


def test_rank_above_max_refused(env):
    engine, model, _, root = env
    big = build_adapter(model, str(root / "r32"), seed=3, r=32)
    with pytest.raises(AdapterError, match="rank 32 exceeds max_lora_rank=16"):
        engine.add_adapter("r32", big)


def test_differing_base_model_name_is_only_a_warning(env, tmp_path, caplog):
    engine, _, good, _ = env
    other = str(tmp_path / "renamed")
    shutil.copytree(good, other)
    edit_config(other, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    with caplog.at_level(logging.WARNING):
        engine.add_adapter("renamed", other)
    assert engine.has_adapter("renamed")
    assert "meta-llama/Llama-3.2-1B" in caplog.text


def test_unknown_adapter_request_refused(env):
    engine = env[0]
    with pytest.raises(AdapterError, match="unknown adapter"):
        engine.add_request(prompt_token_ids=[1, 2], adapter_name="nobody")


def test_name_keeps_its_weights(env, tmp_path):
    """Re-adding the same name and path is a no-op; other weights under a loaded name are refused."""
    engine, model, good, root = env
    engine.add_adapter("good", good)
    other = build_adapter(model, str(tmp_path / "other"), seed=11, r=8)
    with pytest.raises(AdapterError, match="already loaded"):
        engine.add_adapter("good", other)


def test_removed_name_can_be_reused_at_once_when_idle(env, tmp_path):
    engine, model, good, _ = env
    engine.add_adapter("reuse", good)
    engine.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                    adapter_names=["reuse"])
    assert "reuse" in engine.stats()["device_adapters"]
    engine.remove_adapter("reuse")
    assert "reuse" not in engine.stats()["device_adapters"] and not engine.has_adapter("reuse")
    other = build_adapter(model, str(tmp_path / "other2"), seed=12, r=8)
    engine.add_adapter("reuse", other)
    assert engine.has_adapter("reuse")
