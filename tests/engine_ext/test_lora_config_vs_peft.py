"""Every LoraConfig variant PEFT can save, and files edited to disagree with their config: the engine (plain and
speculative) gives PEFT's greedy tokens or refuses, and the registry's validator gives the same verdict for the
same files (both go through engine_ext.lora_config). PEFT + transformers on a small random Llama is the oracle."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.lora_adapter import AdapterError
from tiny_models import build_model, hf_oracle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
pytest.importorskip("pydantic", reason="the registry half of the comparison needs the serving dependencies")
from registry import RegistryValidationError  # noqa: E402
from registry.base_model import spec_from_config  # noqa: E402
from registry.validation import validate_adapter  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
W = "adapter_model.safetensors"

# name -> LoraConfig kwargs PEFT saves and the engine must serve exactly as PEFT does
HONOURED = {
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=ALL, layers_to_transform=[0]),
    "layer_int_and_pattern": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], layers_to_transform=1,
                                  layers_pattern="layers"),
    "full_name_bypasses_layers": dict(r=4, lora_alpha=8, layers_to_transform=[0],
                                      target_modules=["model.layers.1.self_attn.q_proj", "v_proj"]),
    "exclude_list_all_linear": dict(r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["o_proj", "k_proj"]),
    "exclude_regex": dict(r=4, lora_alpha=8, target_modules=ALL, exclude_modules=r".*\.layers\.0\.mlp\..*"),
    "rank_alpha_patterns": dict(r=4, lora_alpha=8, target_modules=ALL,
                                rank_pattern={r"layers\.1\.self_attn\.(q|k)_proj": 6, "model.layers.0.mlp.up_proj": 2},
                                alpha_pattern={"v_proj": 3.5, "model.layers.1.mlp.down_proj": 20}),
    "float_alpha_rslora": dict(r=8, lora_alpha=12.5, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"]),
    "plain_init_false": dict(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False),
}
# name -> (LoraConfig kwargs, words the refusal names)
REFUSED = {
    "dora": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True), "use_dora"),
    "bias_all": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], bias="all"), "bias"),
    "bias_lora_only": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], bias="lora_only"), "bias"),
    "lora_bias": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    "modules_to_save": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
                        "modules_to_save"),
    "embedding_target": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    "lm_head_target": (dict(r=4, lora_alpha=8, target_modules=["v_proj", "lm_head"]), "lm_head"),
    "trainable_tokens": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 5]),
                         "trainable_token_indices"),
}


def _edit_config(**changes):
    def fn(d: Path) -> None:
        cfg = json.loads((d / "adapter_config.json").read_text()) | changes
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return fn


def _drop_tensor(part: str):
    def fn(d: Path) -> None:
        t = load_file(d / W)
        t.pop(next(k for k in sorted(t) if part in k))
        save_file(t, d / W)
    return fn


# name -> (template in HONOURED, edit, words the refusal names): files that disagree with their config
EDITED = {
    # The issue's repro: trained on every layer, config then says layer 0 only; PEFT would drop layer 1's tensors.
    "layers_edited_to_0": ("rank_alpha_patterns", _edit_config(layers_to_transform=[0]), "does not target"),
    "target_dropped": ("rank_alpha_patterns", _edit_config(target_modules=["q_proj", "k_proj"]), "does not target"),
    "exclude_added": ("layers_to_transform", _edit_config(exclude_modules=["gate_proj"]), "does not target"),
    "rank_pattern_edited": ("rank_alpha_patterns", _edit_config(rank_pattern={}), "expected"),
    "factor_missing": ("float_alpha_rslora", _drop_tensor("layers.1.mlp.up_proj.lora_B"), "no factors"),
    "unknown_field": ("plain_init_false", _edit_config(future_feature={"on": True}), "future_feature"),
    "pissa_init": ("plain_init_false", _edit_config(init_lora_weights="pissa"), "init_lora_weights"),
    "regex_with_layers": ("plain_init_false", _edit_config(target_modules=r".*q_proj", layers_to_transform=[0]),
                          "layers_to_transform"),
    "adapter_name_in_keys": ("plain_init_false", lambda d: save_file(
        {k.replace(".weight", ".default.weight"): v for k, v in load_file(d / W).items()}, d / W), "unexpected tensor"),
}


def _peft_adapter(model_dir: str, out: Path, seed: int, kwargs: dict) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(lora_dropout=0.0, **kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "trainable_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-config")
    model = build_model("llama", str(root / "model"))
    honoured = {n: _peft_adapter(model, root / n, i, kw) for i, (n, kw) in enumerate(HONOURED.items())}
    refused = {n: _peft_adapter(model, root / n, 100 + i, kw) for i, (n, (kw, _)) in enumerate(REFUSED.items())}
    return model, honoured, refused, root


def _registry_verdict(model: str, adapter: Path) -> str | None:
    """The registry validator on the same files -> None (accepted) or the refusal message."""
    cfg = json.loads(Path(model, "config.json").read_text())
    spec = spec_from_config("tiny", cfg, aliases=[model])
    files = {p.name: p for p in adapter.iterdir()}
    sha = {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in files.items()}
    try:
        validate_adapter(files, sha, spec, max_rank=64, max_header_bytes=1 << 20)
    except RegistryValidationError as e:
        return e.message
    return None


def _engine_verdict(model: str, adapter: Path) -> str | None:
    engine = LLMEngine(EngineConfig(model=model, max_loras=1))
    try:
        engine.add_adapter("x", str(adapter))
    except AdapterError as e:
        return e.problem
    return None


def test_peft_saved_what_the_cases_claim(setup):
    # Guards the premise: PEFT really wrote the fields and only the tensors the config targets.
    _, honoured, refused, _ = setup
    cfg = json.loads((honoured["layers_to_transform"] / "adapter_config.json").read_text())
    assert cfg["layers_to_transform"] == [0]
    keys = load_file(honoured["layers_to_transform"] / W)
    assert keys and all(".layers.0." in k for k in keys)
    keys = load_file(honoured["full_name_bypasses_layers"] / W)
    assert sorted({k.split(".lora_")[0].split("base_model.model.model.")[1] for k in keys}) == [
        "layers.0.self_attn.v_proj", "layers.1.self_attn.q_proj"]
    assert not any("o_proj" in k or "k_proj" in k for k in load_file(honoured["exclude_list_all_linear"] / W))
    assert any("lora_magnitude_vector" in k for k in load_file(refused["dora"] / W))


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [50, 60, 70, 80, 90, 100]]


@pytest.fixture(scope="module")
def peft_tokens(setup) -> dict:
    """(adapter or None, prompt index) -> PEFT's 16 greedy tokens, computed once for both engine modes."""
    model, honoured, _, _ = setup
    oracle = hf_oracle(model, {n: str(p) for n, p in honoured.items()})
    out = {(n, i): oracle(p, n, 16)[0] for n in honoured for i, p in enumerate(PROMPTS)}
    return out | {(None, i): oracle(p, None, 16)[0] for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("spec", [None, SpecConfig(num_draft_tokens=3, gate=False)], ids=["plain", "speculative"])
def test_honoured_configs_give_peft_greedy_tokens(setup, peft_tokens, spec):
    model, honoured, _, _ = setup
    engine = LLMEngine(EngineConfig(model=model, max_loras=len(honoured), speculative=spec))
    for name, path in honoured.items():
        assert _registry_verdict(model, path) is None, name
        engine.add_adapter(name, str(path))
    names = [n for n in honoured for _ in PROMPTS]
    outs = engine.generate(prompt_token_ids=PROMPTS * len(honoured), adapter_names=names,
                           sampling_params=SamplingParams(max_tokens=16, ignore_eos=True))
    for i, (out, name) in enumerate(zip(outs, names)):
        assert out.token_ids == peft_tokens[(name, i % len(PROMPTS))], f"{name}: engine differs from PEFT"
    # Each adapter really changes PEFT's output (a no-op adapter would pass trivially).
    for name in honoured:
        assert any(peft_tokens[(name, i)] != peft_tokens[(None, i)] for i in range(len(PROMPTS))), name


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unservable_configs_refused_alike_by_engine_and_registry(setup, case):
    model, _, refused, _ = setup
    words = REFUSED[case][1]
    engine_msg, registry_msg = _engine_verdict(model, refused[case]), _registry_verdict(model, refused[case])
    assert engine_msg is not None and words in engine_msg, engine_msg
    assert registry_msg is not None and words in registry_msg, registry_msg


@pytest.mark.parametrize("case", sorted(EDITED))
def test_files_disagreeing_with_their_config_refused_alike(setup, case, tmp_path):
    model, honoured, _, _ = setup
    template, edit, words = EDITED[case]
    d = tmp_path / case
    shutil.copytree(honoured[template], d)
    edit(d)
    engine_msg, registry_msg = _engine_verdict(model, d), _registry_verdict(model, d)
    assert engine_msg is not None and words in engine_msg, engine_msg
    assert registry_msg is not None and words in registry_msg, registry_msg
    assert os.path.isdir(honoured[template])  # the template itself stays servable
    assert _engine_verdict(model, honoured[template]) is None
