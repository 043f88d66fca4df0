"""Adapter slots that start narrow (`EngineConfig.lora_slot_rank`) and grow when a wider adapter arrives mid-run:
every request's tokens equal those of an engine whose slots are max_lora_rank wide from the start, the requests
already decoding when the slots grew and the new adapter's alike, plain and with speculation forced; on a GPU the
CUDA graphs are captured once more, at the first forward after the growth, and never replayed on the old stacks."""

import pytest

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tiny_models import build_adapter, build_model

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def workload(root: str) -> tuple[str, str, str]:
    """(model, a rank-4 q/v adapter, a rank-24 adapter on every projection) under `root`."""
    model = build_model("llama", f"{root}/m")
    narrow = build_adapter(model, f"{root}/narrow", seed=1, r=4, std=0.3)
    wide = build_adapter(model, f"{root}/wide", seed=2, r=24, target_modules=ALL_MODULES, std=0.3)
    return model, narrow, wide


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    return workload(str(tmp_path_factory.mktemp("growth")))


def run(model_and_adapters, backend: dict, slot_rank, spec):
    model, narrow, wide = model_and_adapters
    engine = LLMEngine(EngineConfig(model=model, max_loras=2, max_lora_rank=32, lora_slot_rank=slot_rank,
                                    block_size=4, num_kv_blocks=128, debug_checks=True, speculative=spec, **backend))
    engine.add_adapter("narrow", narrow)
    engine.add_adapter("wide", wide)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("narrow-1", prompt_token_ids=[3, 4, 5, 6], sampling_params=params, adapter_name="narrow")
    engine.add_request("base-1", prompt_token_ids=[3, 4, 5, 6], sampling_params=params)  # narrow-1's prompt
    done: dict[str, list[int]] = {}
    for step in range(400):
        if step == 3:  # the first two are decoding: the wide adapter's request arrives
            engine.add_request("wide-1", prompt_token_ids=[3, 4, 5, 6], sampling_params=params,
                               adapter_name="wide")
        done |= {out.request_id: out.token_ids for out in engine.step() if out.finished}
        if step > 3 and not engine.has_unfinished_requests:
            break
    return engine, done


@pytest.mark.parametrize("spec", [None, SpecConfig(num_draft_tokens=3, gate=False)], ids=["plain", "forced-k3"])
def test_tokens_equal_full_width_slots_when_the_slots_grow_mid_run(model_and_adapters, backend, spec):
    grown_engine, grown = run(model_and_adapters, backend, 8, spec)
    full_engine, full = run(model_and_adapters, backend, None, spec)
    assert sorted(grown) == ["base-1", "narrow-1", "wide-1"] and all(len(t) == 12 for t in grown.values())
    assert grown == full
    # each adapter changes the tokens (a slot left empty or stale by the growth would show)
    assert grown["narrow-1"] != grown["base-1"] and grown["wide-1"] not in (grown["base-1"], grown["narrow-1"])
    slots = grown_engine.adapters.slots
    assert slots.rank == 32 and slots.generation == 1  # 8 -> the next power of two above 24
    assert full_engine.adapters.slots.rank == 32 and full_engine.adapters.slots.generation == 0
    graphs = grown_engine.runner.graphs
    if graphs is not None:  # captured at width 8, then again at width 32
        assert graphs.captures == 2 and full_engine.runner.graphs.captures == 1
