"""PEFT features the engine serves and the registry must accept: rank_pattern / alpha_pattern (per-module rank
and alpha) and target_modules given as a regex string. Adapters are built by real `peft`; the engine's own loader
(engine_ext.lora_adapter) is the second opinion on what is servable, PEFT itself the numerical oracle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from registry import AdapterStatus
from registry.api import create_app
from tests.registry.adapter_kit import BASE, build_adapter, sha_map, stage_copy

W = "adapter_model.safetensors"
ADMIN = {"Authorization": "Bearer admin-token"}
REGEX = r".*\.layers\.1\..*(v_proj|up_proj)"

# key -> (LoraConfig kwargs, rank the record must carry, target_modules the record must carry)
SPECS: dict[str, tuple[dict, int, list[str]]] = {
    # r=4 by default; q_proj everywhere at 8, one down_proj at 2; v_proj gets its own alpha.
    "patterns": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                      rank_pattern={"q_proj": 8, "model.layers.1.mlp.down_proj": 2}, alpha_pattern={"v_proj": 3}),
                 8, ["down_proj", "q_proj", "v_proj"]),
    # Regex target: only layer 1's v_proj and up_proj; up_proj at rank 6, v_proj at r=2.
    "regex": (dict(r=2, lora_alpha=4, target_modules=REGEX, rank_pattern={"up_proj": 6}, alpha_pattern={"up_proj": 12}),
              6, ["up_proj", "v_proj"]),
    # Every targeted module overridden to a lower rank: r itself is never used, so it must not count.
    "r_unused": (dict(r=16, lora_alpha=16, target_modules=["k_proj", "o_proj"],
                      rank_pattern={"k_proj": 3, "o_proj": 5}),
                 5, ["k_proj", "o_proj"]),
    # PEFT's dotted-suffix entries in a list target.
    "suffix": (dict(r=4, lora_alpha=8, target_modules=["self_attn.q_proj", "mlp.gate_proj"]),
               4, ["gate_proj", "q_proj"]),
    # A rank_pattern value above the registry's max_lora_rank (8 in tests) while r is fine.
    "pattern_too_high": (dict(r=4, lora_alpha=8, target_modules=["q_proj"], rank_pattern={"q_proj": 16}),
                         16, ["q_proj"]),
}


@pytest.fixture(scope="session")
def peft_templates(tiny_base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft-features")
    for seed, (key, (kwargs, _, _)) in enumerate(SPECS.items()):
        build_adapter(tiny_base, root / key, seed + 10, lora_kwargs=kwargs, std=0.05)
    return {key: root / key for key in SPECS}


@pytest.fixture
def stage_peft(incoming_root, peft_templates) -> Callable[..., Path]:
    def _stage(template: str, mutate: Callable[[Path], None] | None = None) -> Path:
        return stage_copy(peft_templates[template], incoming_root, f"pf-{template}", mutate)
    return _stage


def _engine_rank(tiny_base: Path, path: Path, max_rank: int = 64) -> int:
    from engine_ext.lora_adapter import load_lora_adapter
    from engine_ext.model_config import load_model_spec

    return load_lora_adapter("x", str(path), load_model_spec(str(tiny_base)), max_rank).rank


def _edit_config(**changes) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        cfg = json.loads((d / "adapter_config.json").read_text()) | changes
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return mutate


def test_peft_built_adapters_have_the_expected_config(peft_templates):
    # Guards the premise: PEFT really saved the patterns and the regex string we test against.
    cfg = json.loads((peft_templates["regex"] / "adapter_config.json").read_text())
    assert cfg["target_modules"] == REGEX and cfg["rank_pattern"] == {"up_proj": 6}
    keys = sorted(load_file(peft_templates["regex"] / W))
    assert keys == sorted(f"base_model.model.model.layers.1.{m}.lora_{f}.weight"
                          for m in ("self_attn.v_proj", "mlp.up_proj") for f in "AB")
    tensors = load_file(peft_templates["patterns"] / W)
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (2, 128)


@pytest.mark.parametrize("key", ["patterns", "regex", "r_unused", "suffix"])
def test_pattern_and_regex_adapters_register_with_max_rank(key, make_registry, stage_peft, tiny_base):
    reg = make_registry("sqlite+local")
    src = stage_peft(key)
    rec = reg.register(f"pf-{key}", str(src), sha_map(src), BASE, actor="t")
    _, rank, targets = SPECS[key]
    assert rec.status == AdapterStatus.ready
    assert (rec.rank, rec.target_modules) == (rank, targets)
    assert rec.alpha == float(SPECS[key][0]["lora_alpha"])
    # The engine, which will serve it, agrees on the rank and accepts the materialized files.
    assert _engine_rank(tiny_base, reg.materialize(rec)) == rank


def test_pattern_adapter_on_redis_s3_backend_and_peft_loads_it(make_registry, stage_peft, tiny_base):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    reg = make_registry("redis+s3")
    src = stage_peft("regex")
    rec = reg.register("pf-regex", str(src), sha_map(src), BASE, activate=True)
    assert rec.status == AdapterStatus.active and rec.rank == 6
    path = reg.materialize(reg.resolve("pf-regex", None))
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    logits = []
    for d in (src, path):
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tiny_base), d).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
        # PEFT applied the per-module rank and alpha from the stored config: up_proj rank 6, scale 12/6.
        up = model.base_model.model.model.layers[1].mlp.up_proj
        assert up.r["default"] == 6 and up.scaling["default"] == pytest.approx(2.0)
    base = LlamaForCausalLM.from_pretrained(tiny_base).eval()
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, logits[0])  # the adapter really changes the output
    torch.testing.assert_close(logits[0], logits[1])


def _swap(name: str, shape: tuple[int, int]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        t = load_file(d / W)
        t[name] = torch.zeros(shape)
        save_file(t, d / W)
    return mutate


Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
UP1 = "base_model.model.model.layers.1.mlp.up_proj.lora_{}.weight"

# id -> (template, mutate, expected code, words in the message)
BAD = {
    # q_proj is rank 8 by rank_pattern; a factor at the default r=4 is wrong even though it matches r.
    "pattern_module_at_default_rank": ("patterns", _swap(Q0.format("A"), (4, 64)), "shape_mismatch", "[8, 64]"),
    "pattern_module_B_wrong_rank": ("patterns", _swap(Q0.format("B"), (64, 4)), "shape_mismatch", "[64, 8]"),
    "regex_module_at_default_rank": ("regex", _swap(UP1.format("A"), (2, 64)), "shape_mismatch", "[6, 64]"),
    "rank_pattern_too_high": ("pattern_too_high", None, "rank_too_high", "rank 16"),
    "invalid_regex": ("regex", _edit_config(target_modules=r".*(v_proj|up_proj"), "bad_config",
                      "not a valid regular expression"),
    "regex_matches_nothing": ("regex", _edit_config(target_modules=r".*\.layers\.7\..*v_proj"),
                              "unknown_target_module", "matches no module"),
    "regex_misses_a_tensor": ("regex", _edit_config(target_modules=r".*\.layers\.1\..*v_proj"), "tensor_mismatch",
                              "up_proj"),
    "invalid_rank_pattern_key": ("patterns", _edit_config(rank_pattern={"q_proj[": 8}), "bad_config",
                                 "not a valid regular expression"),
    "rank_pattern_not_int": ("patterns", _edit_config(rank_pattern={"q_proj": "8"}), "bad_config", "rank_pattern"),
    "rank_pattern_zero": ("patterns", _edit_config(rank_pattern={"q_proj": 0}), "bad_config", "positive"),
    "suffix_entry_matches_nothing": ("suffix", _edit_config(target_modules=["mlp.q_proj"]), "unknown_target_module",
                                     "mlp.q_proj"),
    "use_dora_still_refused": ("patterns", _edit_config(use_dora=True), "bad_config", "use_dora"),
    "modules_to_save_still_refused": ("patterns", _edit_config(modules_to_save=["lm_head"]), "bad_config",
                                      "modules_to_save"),
    "bias_still_refused": ("patterns", _edit_config(bias="all"), "bad_config", "bias"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_pattern_and_regex_adapters_refused_via_api(case, make_registry, stage_peft):
    reg = make_registry("sqlite+local")
    client = TestClient(create_app(reg, {"admin-token": {"role": "admin", "name": "root"}}))
    template, mutate, code, words = BAD[case]
    src = stage_peft(template, mutate)
    resp = client.post("/v1/adapters", headers=ADMIN, json={"name": "bad", "source_uri": str(src),
                       "sha256": sha_map(src), "base_model": BASE})
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and words in err["message"], err
    assert reg.list_states() == [] and reg.blobs.list() == []


@pytest.mark.parametrize("case", ["pattern_module_at_default_rank", "regex_module_at_default_rank"])
def test_engine_also_refuses_the_wrong_rank_tensor(case, stage_peft, tiny_base):
    # The registry's refusal matches the engine's: the same files would fail to load for serving.
    from engine_ext.lora_adapter import AdapterError

    template, mutate, _, _ = BAD[case]
    with pytest.raises(AdapterError):
        _engine_rank(tiny_base, stage_peft(template, mutate))
