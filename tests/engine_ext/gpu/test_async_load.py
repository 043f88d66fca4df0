"""Adapter loads on a side stream: the same slot contents as a synchronous load, a slot nobody reads or
evicts before its copy lands, and running requests that never notice a cold adapter coming in."""

import pytest
import torch

from backends import CUDA_TORCH, CUDA_TRITON_GRAPHS
from engine_ext import EngineConfig, LLMEngine, SamplingParams
from engine_ext.adapter_slots import AdapterSlots, pack_adapter
from engine_ext.lora_adapter import load_lora_adapter
from engine_ext.model_config import load_model_spec
from tiny_models import build_adapter, build_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {
    "x": dict(r=16, target_modules=ALL, std=0.08),
    "y8": dict(r=8, target_modules=("q_proj", "v_proj", "down_proj"), std=0.1),  # below R: staged, then unpacked
    "y64": dict(r=64, alpha=64, target_modules=ALL, std=0.08),  # at R: copied straight into the slot
}
MAX_RANK = 64
X_PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
Y_PROMPTS = {"y8": [[3, 3, 5], [50, 60, 70, 80]], "y64": [[5, 4, 3, 2, 1, 9]]}
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
JOIN_STEP = 3  # the cold adapters' requests arrive while x's requests are decoding
# torch.cuda._sleep on the copy stream: ~1 s, so a load spans several steps even when other processes share the
# GPU (the sleep counts SM clock cycles, which run on while the GPU serves another process: at 50 ms the cold
# load once ended within one of x's steps under pytest-xdist, run 20)
HOLD_CYCLES = 2_000_000_000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("async-load")
    model = build_model("llama", str(root / "m"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    return model, adapters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_async_load_writes_what_a_synchronous_load_writes(setup, dtype):
    model, adapters = setup
    spec = load_model_spec(model)
    cpu = AdapterSlots(spec, 2, MAX_RANK, dtype, torch.device("cpu"))
    gpu = AdapterSlots(spec, 2, MAX_RANK, dtype, torch.device("cuda"))
    for name in ["x", "y8", "y64", "x", "y8"]:  # three adapters through two slots: evictions and reloads
        w = load_lora_adapter(name, adapters[name], spec, MAX_RANK)
        slot = cpu.activate(pack_adapter(w, spec, dtype, pin=False), set())
        assert gpu.activate(pack_adapter(w, spec, dtype, pin=True), set()) == slot
        gpu.synchronize()
    assert gpu.resident == cpu.resident
    assert torch.equal(gpu.slab.cpu(), cpu.slab) and torch.equal(gpu.scale_slab.cpu(), cpu.scale_slab)
    assert not gpu.slab[gpu.zero_slot].any()


def test_a_slot_is_loading_until_its_copy_lands(setup):
    model, adapters = setup
    spec = load_model_spec(model)
    slots = AdapterSlots(spec, 1, MAX_RANK, torch.float32, torch.device("cuda"))
    packed = {n: pack_adapter(load_lora_adapter(n, adapters[n], spec, MAX_RANK), spec, torch.float32, pin=True)
              for n in ("x", "y64")}
    torch.cuda._sleep(HOLD_CYCLES)  # the compute stream is busy: the copy waits behind what it has queued
    assert slots.activate(packed["x"], set()) == 0
    assert slots.slot_of("x") == 0 and not slots.ready("x") and slots.loading
    assert not slots.can_activate("y64", busy=set())  # the only slot has a copy in flight: not evictable
    assert not slots.deactivate("x")
    slots.synchronize()
    assert slots.ready("x") and not slots.loading
    assert slots.activate(packed["y64"], set()) == 0  # landed and idle: evictable now
    slots.synchronize()
    ref = AdapterSlots(spec, 1, MAX_RANK, torch.float32, torch.device("cpu"))
    ref.activate(pack_adapter(load_lora_adapter("y64", adapters["y64"], spec, MAX_RANK), spec, torch.float32,
                              pin=False), set())
    assert torch.equal(slots.slab.cpu(), ref.slab)


def test_a_copy_is_issued_once_a_forward_is_queued(setup):
    """activate only takes the slot; the copy is issued by flush, which the runner calls after queuing a forward,
    so its host time overlaps the device's work. Until then the slot is loading, not ready, not evictable."""
    model, adapters = setup
    engine = _engine(model, adapters, True)
    slots = engine.adapters.slots
    engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2))  # graphs captured
    assert engine.adapters.try_activate("y64", set())
    slot = slots.slot_of("y64")
    assert slots._loads[slot].done is None  # pending: nothing issued yet
    assert slots.loading and not slots.ready("y64") and not slots.deactivate("y64")
    engine.add_request("z", prompt_token_ids=[4, 5, 6], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # its forward is queued, then the pending copy issued
    assert slots._loads.get(slot) is None or slots._loads[slot].done is not None
    slots.synchronize()
    assert slots.ready("y64") and not slots.loading


def _engine(model, adapters, fast: bool) -> LLMEngine:
    """fast: False (eager torch), True (Triton + graphs). The slots are MAX_RANK wide from the start: a cold load,
    not a growth (test_slot_growth.py), is what these tests hold in flight (a growth waits for the held copy)."""
    backend = CUDA_TRITON_GRAPHS if fast else CUDA_TORCH
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_loras=3, max_lora_rank=MAX_RANK,
                                    lora_slot_rank=None, block_size=4, max_model_len=128, num_kv_blocks=256,
                                    **backend))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


def _run(engine: LLMEngine, with_y: bool, hold: bool = False) -> tuple[dict[str, list[int]], int]:
    """x's requests from the start, the y adapters' after JOIN_STEP steps. Returns (tokens by request id,
    steps that decoded x while a copy was in flight)."""
    for i, p in enumerate(X_PROMPTS):
        engine.add_request(f"x{i}", prompt_token_ids=p, sampling_params=PARAMS, adapter_name="x")
    done, step, overlapped = {}, 0, 0
    while step <= JOIN_STEP or engine.has_unfinished_requests:
        if step == JOIN_STEP and with_y:
            if hold:  # keep the copies in flight for a while, so x's steps certainly run beside them
                with torch.cuda.stream(engine.adapters.slots.copy_stream):
                    torch.cuda._sleep(HOLD_CYCLES)
            for name, prompts in Y_PROMPTS.items():
                for i, p in enumerate(prompts):
                    engine.add_request(f"{name}-{i}", prompt_token_ids=p, sampling_params=PARAMS, adapter_name=name)
        outs = engine.step()
        for out in outs:
            if out.finished:
                done[out.request_id] = out.token_ids
        overlapped += engine.adapters.slots.loading and any(o.request_id.startswith("x") for o in outs)
        step += 1
    return done, overlapped


@pytest.mark.parametrize("fast", [False, True], ids=["eager", "triton-graphs"])
def test_a_cold_load_changes_nothing_for_running_requests(setup, fast):
    model, adapters = setup
    alone, _ = _run(_engine(model, adapters, fast), with_y=False)

    warm = _engine(model, adapters, fast)
    for name in Y_PROMPTS:
        assert warm.adapters.try_activate(name, set())
    warm.adapters.slots.synchronize()
    preloaded, _ = _run(warm, with_y=True)

    cold = _engine(model, adapters, fast)
    assert cold.adapters.slots.resident == []
    outs, overlapped = _run(cold, with_y=True, hold=True)

    assert overlapped >= 2  # x kept decoding while y's copies were in flight
    assert {k: v for k, v in outs.items() if k.startswith("x")} == alone
    assert outs == preloaded
    stats = cold.stats()["adapters"]
    assert stats["y8"]["loads"] == stats["y64"]["loads"] == 1 and stats["y8"]["hits"] == 0
