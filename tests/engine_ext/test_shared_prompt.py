"""Samples of one prompt share its KV blocks: a request added with `share_prompt_with` takes over the full
blocks of its source's computed prompt instead of computing them again. Outputs are those of unshared
requests, the KV cache comes back whole (shared blocks are freed by their last holder), and fewer blocks
are in use at the peak. The outputs-and-blocks test runs on every backend (the `backend` fixture), the rest
on the CPU."""

import pytest

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.block_manager import BlockManager
from tiny_models import build_adapter, build_model

PROMPT = list(range(3, 40))  # 37 tokens: 9 full blocks of 4, the last token computed by every sample


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-prompt")
    model = build_model("llama", str(root / "m"))
    return model, build_adapter(model, str(root / "a"), seed=1, r=8)


def _engine(setup, spec=None, num_kv_blocks=256, **backend):
    model, adapter = setup
    engine = LLMEngine(EngineConfig(model=model, max_loras=2, block_size=4, num_kv_blocks=num_kv_blocks,
                                    speculative=spec, debug_checks=True, **backend))
    engine.add_adapter("a", adapter)
    return engine


def _samples(engine, share: bool, adapter="a", n=3, temperature=1.0):
    ids = []
    for i in range(n):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=100 + i, ignore_eos=True)
        ids.append(engine.add_request(f"s{i}", prompt_token_ids=PROMPT, sampling_params=params, adapter_name=adapter,
                                      share_prompt_with="s0" if share and i else None))
    outs = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    return [outs[i] for i in ids]


# Seeded sampling draws the same token at the same position whatever the batch and whether drafted or not.
@pytest.mark.parametrize("spec, temperature", [(None, 1.0), (SpecConfig(num_draft_tokens=3, gate=False), 0.0),
                                               (SpecConfig(num_draft_tokens=3, gate=False), 1.0)],
                         ids=["plain-sampled", "speculative-greedy", "speculative-sampled"])
@pytest.mark.parametrize("adapter", ["a", None])
def test_shared_prompt_gives_the_unshared_outputs_with_fewer_blocks(setup, spec, temperature, adapter, backend):
    unshared = _engine(setup, spec, **backend)
    expected = _samples(unshared, share=False, adapter=adapter, temperature=temperature)
    shared = _engine(setup, spec, **backend)
    assert _samples(shared, share=True, adapter=adapter, temperature=temperature) == expected
    for engine in (shared, unshared):
        assert engine.blocks.num_free == engine.blocks.num_blocks  # every block back, shared ones included
    # Each of the two later samples took over the source's 9 full prompt blocks.
    assert shared.blocks.peak_used <= unshared.blocks.peak_used - 2 * 9 + 2


def test_share_waits_for_the_source_prompt_and_survives_its_preemption_and_finish(setup):
    engine = _engine(setup, num_kv_blocks=40)  # room for about three of these sequences at once
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("src", prompt_token_ids=PROMPT, sampling_params=params, adapter_name="a")
    engine.add_request("copy", prompt_token_ids=PROMPT, sampling_params=params, adapter_name="a",
                       share_prompt_with="src")
    engine.step()  # the source's prompt is computed first; the copy waits for it
    copy = engine.seqs["copy"]
    assert engine.seqs["src"].num_computed == len(PROMPT) and copy.status.name == "WAITING"
    engine.step()  # the copy takes over the source's 9 full prompt blocks and computes its last token
    assert copy.num_computed >= 9 * 4 and copy.block_table[:9] == engine.seqs["src"].block_table[:9]
    engine.add_request("big", prompt_token_ids=list(range(50, 90)), sampling_params=params)  # forces preemption
    outs = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    assert engine.stats()["num_preemptions"] > 0
    assert outs["copy"] == outs["src"]  # greedy: the same text from the same prompt
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_share_prompt_with_an_unknown_or_different_request_is_ignored(setup):
    engine = _engine(setup)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("x", prompt_token_ids=PROMPT, sampling_params=params, adapter_name="a")
    engine.add_request("y", prompt_token_ids=PROMPT[:-1], sampling_params=params, adapter_name="a",
                       share_prompt_with="x")  # another prompt
    engine.add_request("z", prompt_token_ids=PROMPT, sampling_params=params, share_prompt_with="x")  # another adapter
    engine.add_request("w", prompt_token_ids=PROMPT, sampling_params=params, share_prompt_with="nope")
    assert all(engine.seqs[r].prompt_source is None for r in "yzw")
    engine.generate(prompt_token_ids=[[1, 2]], sampling_params=params)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_block_manager_frees_a_shared_block_with_its_last_holder():
    blocks = BlockManager(8, 4)
    a, b, c = [], [], []
    blocks.allocate(a, 12)  # 3 blocks
    blocks.share(a, 2, b)
    blocks.share(a, 2, c)
    assert b == c == a[:2] and blocks.num_free == 5
    blocks.free(a)
    assert blocks.num_free == 6  # only a's own third block
    blocks.free(b)
    assert blocks.num_free == 6
    blocks.free(c)
    assert blocks.num_free == 8
    with pytest.raises(ValueError, match="empty table"):
        blocks.share(a, 1, [5])
