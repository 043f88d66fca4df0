"""Prefix caching keyed by adapter (EngineConfig.enable_prefix_caching): a request takes the KV of the longest cached
chain of full blocks of its own adapter version instead of computing it. Greedy outputs are the uncached engine's
for one prefix sent with adapter A, adapter B, the base model and A again, interleaved, with speculation on and off,
through preemption, aborts and an adapter version change; hits happen only within one (adapter, version); the
cached KV is the adapter-on target's (never drafted KV); and cached blocks never cost a running request its room.
The exactness tests run on every backend (the `backend` fixture), the rest on the CPU."""

import pytest
import torch

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.block_manager import BlockManager
from engine_ext.prefix_cache import chain_hashes, root_hash
from tiny_models import build_adapter, build_model

BS = 4
PREFIX = list(range(3, 40))  # 37 tokens: 9 full blocks of 4
SPECS = [None, SpecConfig(num_draft_tokens=3, gate=False)]
SPEC_IDS = ["plain", "speculative"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-cache")
    model = build_model("llama", str(root / "m"))
    adapters = {name: build_adapter(model, str(root / name), seed=seed, r=8)
                for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    return model, adapters


def _engine(setup, caching, spec=None, num_kv_blocks=256, max_num_seqs=64, detokenize=True, **backend):
    model, adapters = setup
    engine = LLMEngine(EngineConfig(model=model, max_loras=3, block_size=BS, num_kv_blocks=num_kv_blocks,
                                    max_num_seqs=max_num_seqs, speculative=spec, enable_prefix_caching=caching,
                                    debug_checks=True, **backend), detokenize=detokenize)
    engine.add_adapter("a", adapters["a"])
    engine.add_adapter("b", adapters["b"])
    return engine


def _run(engine, requests, max_tokens=12):
    """requests: (id, prompt, adapter), all added at once -> id -> generated token ids."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt_token_ids=prompt, sampling_params=params, adapter_name=adapter)
    outs = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    return outs


def _hits(engine, adapter):
    cache = engine.stats()["prefix_cache"]
    return (cache["base"] if adapter is None else cache["adapters"].get(adapter, {"hits": 0}))["hits"]


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_cached_outputs_equal_uncached_and_hits_stay_within_the_adapter(setup, spec, backend):
    waves = [[("a1", PREFIX + [50], "a")], [("b1", PREFIX + [50], "b")], [("base1", PREFIX + [50], None)],
             [("a2", PREFIX + [51, 52], "a")],
             [("a3", PREFIX + [53], "a"), ("b2", PREFIX + [54, 55], "b"), ("base2", PREFIX + [56], None),
              ("a4", PREFIX + [50], "a")]]
    cached, plain = _engine(setup, True, spec, **backend), _engine(setup, False, spec, **backend)
    got, want, hits = {}, {}, []
    for wave in waves:
        got |= _run(cached, wave)
        want |= _run(plain, wave)
        hits.append({a: _hits(cached, a) for a in ("a", "b", None)})
    # A multi-turn follow-up: the first turn's prompt and answer resent, then more text; its answer's blocks (written
    # by decode steps, or by verify passes with speculation) are cached too.
    turn = [("a5", PREFIX + [50] + got["a1"] + [60, 61, 62], "a")]
    got |= _run(cached, turn)
    want |= _run(plain, turn)
    assert got == want
    assert hits[0] == {"a": 0, "b": 0, None: 0}
    assert hits[1] == hits[0]  # B's first request finds nothing of A's same prefix
    assert hits[2] == hits[0]  # nor does the base model
    assert hits[3]["a"] == 9 * BS and hits[3]["b"] == 0  # A again: the 9 full blocks of the prefix
    assert hits[4]["b"] == 9 * BS and hits[4][None] == 9 * BS and hits[4]["a"] >= hits[3]["a"] + 2 * 9 * BS
    assert _hits(cached, "a") - hits[4]["a"] >= (len(PREFIX) + 1 + 12) // BS * BS - BS  # most of the first turn
    assert cached.blocks.num_free == cached.blocks.num_blocks  # cached blocks no one holds count as free


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_adapter_version_change_drops_its_blocks_and_hits_nothing_of_the_old_version(setup, spec, backend):
    _, adapters = setup
    engine = _engine(setup, True, spec, **backend)
    first = _run(engine, [("v1", PREFIX + [50], "a"), ("base", PREFIX + [50], None)])
    cached_before = engine.blocks.num_cached
    engine.remove_adapter("a")
    assert engine.blocks.num_cached == cached_before - len(PREFIX + [50] + first["v1"][:-1]) // BS  # a's only
    engine.add_adapter("a", adapters["c"])  # the name again, other weights: another version
    second = _run(engine, [("v2", PREFIX + [50], "a")])
    assert _hits(engine, "a") == 0
    reference = _engine(setup, False, spec, **backend)
    reference.remove_adapter("a")
    reference.add_adapter("a", adapters["c"])
    assert second == _run(reference, [("v2", PREFIX + [50], "a")])
    assert second["v2"] != first["v1"]  # the weights differ (else the test could not tell versions apart)


def test_outputs_hold_through_preemption(setup):
    # 40 blocks of 4 tokens: about three of these sequences at once, so the scheduler preempts and recomputes
    requests = [(f"r{i}", PREFIX + [60 + i] * 5, ("a", "b", None, "a")[i]) for i in range(4)]
    cached, plain = _engine(setup, True, num_kv_blocks=40), _engine(setup, False, num_kv_blocks=40)
    _run(cached, [("warm", PREFIX + [70], "a")])  # the prefix of a cached for the run
    assert _run(cached, requests, max_tokens=40) == _run(plain, requests, max_tokens=40)
    assert cached.stats()["num_preemptions"] > 0
    assert cached.blocks.num_free == cached.blocks.num_blocks


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_an_unread_prompt_is_not_cached_and_aborts_leave_the_cache_exact(setup, spec):
    engine = _engine(setup, True, spec)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("gone", prompt_token_ids=PREFIX + [50], sampling_params=params, adapter_name="a")
    engine.step()  # its prompt is queued on the device, not read
    engine.abort_request("gone")
    while engine.has_unfinished_requests:
        engine.step()
    assert engine.blocks.num_cached == 0  # KV of a step never read is never filed
    engine.add_request("read", prompt_token_ids=PREFIX + [51], sampling_params=params, adapter_name="a")
    engine.step()
    engine.step()  # the prompt's step is read: its full blocks are filed
    assert engine.blocks.num_cached >= 9
    engine.abort_request("read")
    got = _run(engine, [("after", PREFIX + [52], "a")], max_tokens=8)["after"]
    assert _hits(engine, "a") == 9 * BS
    assert got == _run(_engine(setup, False, spec), [("after", PREFIX + [52], "a")], max_tokens=8)["after"]


def test_cached_kv_is_the_adapter_on_targets_never_drafted(setup):
    """Every block the speculative engine cached (its decoded tokens' KV written by drafting passes with the adapter
    off, then by the verify pass) holds the KV a plain prefill of the same tokens with the adapter on writes."""
    drafting = _engine(setup, True, SpecConfig(num_draft_tokens=3, gate=False))
    out = _run(drafting, [("x", PREFIX + [50], "a")], max_tokens=24)["x"]
    assert drafting.stats()["speculative"]["cycles"] > 0
    tokens = PREFIX + [50] + out
    reference = {}
    for adapter in ("a", None):
        engine = _engine(setup, True)
        _run(engine, [("y", tokens, adapter)], max_tokens=1)
        reference[adapter] = engine
    size = drafting.blocks.block_size
    hashes: list[bytes] = []
    chain_hashes(hashes, root_hash("a", drafting.adapters.versions["a"]), tokens, size, (len(tokens) - 1) // size)
    base: list[bytes] = []
    chain_hashes(base, root_hash(None, 0), tokens, size, len(hashes))
    decoded = [i for i in range(len(hashes)) if i * size >= len(PREFIX) + 1]
    assert len(decoded) >= 4
    for i in range(len(hashes)):
        got = _kv(drafting, hashes[i])
        want = _kv(reference["a"], hashes[i])
        assert torch.allclose(got, want, atol=1e-4), f"block {i}"
        if i in decoded:  # the adapter changes the KV far beyond the tolerance: adapter-off KV would fail above
            assert not torch.allclose(got, _kv(reference[None], base[i]), atol=1e-2)


def _kv(engine, chain_hash):
    block = engine.blocks.lookup([chain_hash])
    assert block, "the block is cached"
    return torch.stack([torch.stack([k[block[0]], v[block[0]]]) for k, v in engine.runner.kv_caches])


# ---------------------------------------------------------------- memory
def test_cached_blocks_never_cost_a_running_request_its_room(setup):
    """A cache full of other prompts' blocks: the same heavy workload preempts exactly as often as in an engine
    with nothing cached, and gives the same outputs; the cached blocks were evicted for it."""
    cached, plain = _engine(setup, True, num_kv_blocks=48), _engine(setup, False, num_kv_blocks=48)
    for i in range(6):  # distinct prompts, one at a time: their blocks fill the cache
        _run(cached, [(f"fill{i}", [i + 1] * 30, "b")], max_tokens=4)
    assert cached.blocks.num_cached >= 40 and cached.blocks.num_free == cached.blocks.num_blocks
    heavy = [(f"h{i}", [100 + i] * 20, "a") for i in range(4)]
    assert _run(cached, heavy, max_tokens=40) == _run(plain, heavy, max_tokens=40)
    assert cached.stats()["num_preemptions"] == plain.stats()["num_preemptions"]
    assert cached.stats()["prefix_cache"]["evictions"] > 0


def test_stats_report_queries_and_hits_per_adapter(setup):
    engine = _engine(setup, True)
    _run(engine, [("x", PREFIX + [50], "a")])
    _run(engine, [("y", PREFIX + [51], "a"), ("z", PREFIX + [51], None)])
    cache = engine.stats()["prefix_cache"]
    assert cache["adapters"]["a"] == {"queries": 2 * 38, "hits": 9 * BS, "hit_rate": 9 * BS / 76}
    assert cache["base"] == {"queries": 38, "hits": 0, "hit_rate": 0.0}
    assert (cache["queries"], cache["hits"]) == (3 * 38, 9 * BS)
    assert cache["cached_blocks"] == engine.blocks.num_cached > 0
    assert "prefix_cache" not in _engine(setup, False).stats()


# ---------------------------------------------------------------- the block manager and the keys
def test_block_manager_keeps_released_cached_blocks_until_the_room_is_needed():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = []
    bm.allocate(a, 12)  # 3 blocks
    for i, h in enumerate((b"h0", b"h1")):
        bm.register(a[i], h, b"root")
    assert bm.lookup([b"h0", b"h1", b"h2"]) == a[:2] and bm.lookup([b"h1"]) == [a[1]]
    bm.free(a)
    assert bm.num_free == 6 and bm.num_cached == 2  # cached, and counted free
    b = []
    assert bm.can_allocate(b, 24, hits=[]) and not bm.can_allocate(b, 28, hits=[])
    hits = bm.lookup([b"h0", b"h1"])
    assert bm.can_allocate(b, 24, hits) and not bm.can_allocate(b, 28, hits)
    bm.take(hits, b)
    assert bm.num_free == 4 and b == hits
    c = []
    bm.take(bm.lookup([b"h0"]), c)  # a held cached block: one more holder
    bm.free(b)
    assert bm.num_free == 5 and bm.lookup([b"h0", b"h1"]) == hits  # h1 cached again, h0 still held by c
    bm.free(c)
    d = []
    bm.allocate(d, 16)  # 4 free blocks first: nothing evicted
    assert bm.num_cached == 2 and bm.evictions == 0
    bm.allocate(d, 20)  # then the least recently released: h1 (freed before h0)
    assert bm.evictions == 1 and bm.lookup([b"h0", b"h1"]) == [hits[0]]
    bm.free(d)
    assert bm.num_free == 6


def test_dropping_a_root_frees_its_cached_blocks_and_files_none_again():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = [], []
    bm.allocate(a, 8)
    bm.allocate(b, 4)
    bm.register(a[0], b"x0", b"x")
    bm.register(a[1], b"x1", b"x")
    bm.register(b[0], b"y0", b"y")
    bm.free(a)
    assert bm.drop(b"x") == 2 and bm.num_cached == 1 and bm.num_free == 3
    bm.register(b[0], b"x2", b"x")  # retired: ignored
    assert bm.lookup([b"x2"]) == [] and bm.lookup([b"y0"]) == b
    bm.register(b[0], b"y0-again", b"y")  # a block is filed once
    assert bm.lookup([b"y0-again"]) == []


def test_chain_hashes_depend_on_adapter_version_tokens_and_parent():
    def chain(root, tokens):
        out: list[bytes] = []
        chain_hashes(out, root, tokens, 4, len(tokens) // 4)
        return out

    a1, a2, b1, base = root_hash("a", 1), root_hash("a", 2), root_hash("b", 1), root_hash(None, 0)
    t = list(range(8))
    assert chain(a1, t) == chain(a1, t) and len(chain(a1, t)) == 2
    assert len({chain(r, t)[0] for r in (a1, a2, b1, base)}) == 4
    assert root_hash("None", 0) != base
    assert chain(a1, t)[1] != chain(a1, [9] + t[1:])[1]  # the second block's key covers the first's tokens
    partial = chain(a1, t[:4])
    chain_hashes(partial, a1, t, 4, 2)  # extended where it left off
    assert partial == chain(a1, t)


def test_a_withdrawn_version_drops_its_blocks_and_caches_again_when_served_again(setup):
    engine = _engine(setup, True)
    _run(engine, [("x", PREFIX + [50], "a"), ("y", PREFIX + [50], "b")])
    b_blocks = engine.blocks.num_cached // 2
    assert engine.drop_cached_prefixes("a") == b_blocks and engine.drop_cached_prefixes("nope") == 0
    _run(engine, [("x2", PREFIX + [51], "a")])
    assert _hits(engine, "a") == 0 and _hits(engine, "b") == 0
    _run(engine, [("x3", PREFIX + [52], "a")])  # still registered: it cached again
    assert _hits(engine, "a") == 9 * BS


def test_switching_caching_off_and_on_starts_cold_and_counts_afresh(setup):
    engine = _engine(setup, True)
    _run(engine, [("x", PREFIX + [50], "a")])
    engine.set_prefix_caching(False)
    assert engine.blocks.num_cached == 0 and "prefix_cache" not in engine.stats()
    _run(engine, [("y", PREFIX + [50], "a")])
    assert engine.blocks.num_cached == 0  # off: nothing filed
    engine.set_prefix_caching(True)
    _run(engine, [("z", PREFIX + [50], "a")])
    assert _hits(engine, "a") == 0 and engine.blocks.num_cached > 0


def test_the_async_engine_drops_a_versions_blocks_between_steps(setup):
    import asyncio

    from engine_ext import AsyncLLMEngine

    async def scenario(engine):
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(prompt_token_ids=PREFIX + [50], sampling_params=params, adapter_name="a"):
            pass
        cached = engine.engine.blocks.num_cached
        engine.drop_cached_prefixes("a")  # returns at once; the engine thread runs it
        for _ in range(100):
            if engine.engine.blocks.num_cached == 0:
                break
            await asyncio.sleep(0.02)
        return cached, engine.engine.blocks.num_cached

    engine = AsyncLLMEngine(EngineConfig(), engine=_engine(setup, True, detokenize=False))
    try:
        cached, after = asyncio.run(scenario(engine))
    finally:
        engine.shutdown()
    assert cached >= 9 and after == 0
