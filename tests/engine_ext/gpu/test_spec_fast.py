"""The one-sync greedy drafting cycle on the GPU with CUDA graphs: its passes are queued back to back, each
reading its input ids from the device, and the output is token-for-token that of plain decoding with graphs."""

import warnings

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.batch import SeqWork
from tiny_models import build_adapter, build_model

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {
    "near-r8": dict(r=8, target_modules=ALL, std=0.02),
    "near-r16": dict(r=16, target_modules=("q_proj", "v_proj", "down_proj"), std=0.03),
    "far-r64": dict(r=64, alpha=64, target_modules=ALL, std=0.08),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [3, 3], [50, 60, 70], [5, 4, 3, 2, 1, 9]]
NAMES = ["near-r8", None, "near-r16", "far-r64", "near-r8", None]  # None: base-only riders
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)
FAST = dict(device="cuda", lora_backend="triton", attn_backend="triton", layer_ops="triton", cuda_graphs=True,
            max_graph_tokens=48)


def _engine(model, adapters, spec):
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_loras=4, block_size=4, max_model_len=128,
                                    num_kv_blocks=256, speculative=spec, **FAST))
    for n, p in adapters.items():
        engine.add_adapter(n, p)
    return engine


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-spec-fast")
    model = build_model("llama", str(root / "m"))
    adapters = {n: build_adapter(model, str(root / n), seed=i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    plain = _engine(model, adapters, None)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS,
                                                    adapter_names=NAMES)]
    return model, adapters, expected


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_cycle_matches_plain_decoding_with_graphs(setup, k):
    model, adapters, expected = setup
    engine = _engine(model, adapters, SpecConfig(num_draft_tokens=k, gate=False))
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats["speculative"]["cycles"] > 0 and stats["speculative"]["greedy_cycles"] == stats["speculative"]["cycles"]
    assert stats["adapters"]["near-r8"]["accepted_tokens"] > 0
    assert stats["free_kv_blocks"] == stats["total_kv_blocks"]


def test_greedy_cycle_syncs_the_host_once(setup, monkeypatch):
    """Every operation that makes the host wait for the device warns under sync debug mode: a greedy cycle
    has exactly one (reading drafts and verdicts after the verify pass), however many passes it queues."""
    model, adapters, expected = setup
    engine = _engine(model, adapters, SpecConfig(num_draft_tokens=3, gate=False))
    engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)  # capture, loads
    cycle, syncs = engine.speculator._greedy_cycle, []

    def counted(*args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                cycle(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))

    monkeypatch.setattr(engine.speculator, "_greedy_cycle", counted)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    assert [o.token_ids for o in outs] == expected
    # Measured on the H200: the batch's first cycle syncs once more (it carries the prompts' prefill and
    # may grow the pinned buffer ring); every later cycle exactly once, however many passes it queues.
    assert len(syncs) > 2 and syncs[0] <= 2 and syncs[1:] == [1] * (len(syncs) - 1), f"host syncs per cycle: {syncs}"


def test_sampled_request_takes_the_pass_by_pass_cycle(setup):
    model, adapters, expected = setup
    engine = _engine(model, adapters, SpecConfig(num_draft_tokens=3, gate=False))
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    outs = engine.generate(prompt_token_ids=PROMPTS + [[2, 4, 6], [8, 6, 4]],
                           sampling_params=[PARAMS] * len(PROMPTS) + [sampled, sampled],
                           adapter_names=NAMES + ["near-r8", None])
    assert [o.token_ids for o in outs[: len(PROMPTS)]] == expected
    spec = engine.stats()["speculative"]
    assert 0 < spec["greedy_cycles"] < spec["cycles"]


def test_returned_logits_of_riders_and_drafters(setup):
    """Riders' rows are kept from each drafting pass before the next replay reuses the graph's output."""
    model, adapters, _ = setup
    params = SamplingParams(max_tokens=10, ignore_eos=True, return_logits=True)
    names = ["near-r8", None, "near-r16"]
    plain = _engine(model, adapters, None).generate(prompt_token_ids=PROMPTS[:3], sampling_params=params,
                                                     adapter_names=names)
    engine = _engine(model, adapters, SpecConfig(num_draft_tokens=3, gate=False))
    spec = engine.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params, adapter_names=names)
    assert engine.stats()["speculative"]["greedy_cycles"] > 0
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-3, atol=1e-3)


def test_queued_forwards_read_ids_written_by_earlier_ones(setup):
    """ModelRunner.run(owned=False) with graphs: three decode steps and a verify-shaped adapter pass queued with no
    sync, each taking ids from the previous one's argmax on the device, equal the same steps run one by one."""
    model, adapters, _ = setup
    engine = _engine(model, adapters, None)
    runner, slots = engine.runner, engine.adapters.slots
    engine.generate(prompt_token_ids=[[1]], sampling_params=SamplingParams(max_tokens=1), adapter_names=["near-r8"])
    lora, zero = engine.adapters.slot_of("near-r8"), slots.zero_slot
    prompts, tables = [[1, 2, 3, 4, 5], [7, 8, 9]], [[0, 1, 2], [3, 4, 5]]

    def prefill():
        return runner.run([SeqWork(p, 0, t, zero) for p, t in zip(prompts, tables)], slots)

    def verify(ids):  # [a, 17] on the adapter for the first sequence, [b] base-only for the second
        return [SeqWork([ids[0], 17], 8, tables[0], lora, num_logits=2), SeqWork([ids[1]], 6, tables[1], zero)]

    ids, ref = prefill().argmax(-1).tolist(), []
    for j in range(3):
        logits = runner.run([SeqWork([ids[i]], len(p) + j, t, zero) for i, (p, t) in enumerate(zip(prompts, tables))],
                            slots, use_lora=False)
        ref.append(logits)
        ids = logits.argmax(-1).tolist()
    ref.append(runner.run(verify(ids), slots))

    tokens = torch.empty(8, dtype=torch.long, device="cuda")
    tokens[:2] = prefill().argmax(-1)
    got = []
    for j in range(3):
        work = [SeqWork([0], len(p) + j, t, zero) for p, t in zip(prompts, tables)]
        logits = runner.run(work, slots, use_lora=False, tokens=tokens, token_src=[2 * j, 2 * j + 1], owned=False)
        torch.argmax(logits, dim=-1, out=tokens[2 * j + 2 : 2 * j + 4])
        got.append(logits.clone())
    got.append(runner.run(verify([0, 0]), slots, tokens=tokens, token_src=[6, -1, 7], owned=False).clone())
    torch.cuda.synchronize()
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
