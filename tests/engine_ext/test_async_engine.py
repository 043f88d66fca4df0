"""AsyncLLMEngine, with its engine core on a thread of the test's process and in a process of its own (each test
runs in both modes): streaming tokens as they are produced, abort, stop strings applied by the client, adapters,
and errors before the first token."""

import asyncio
import threading

import pytest

from char_tokenizer import add_char_tokenizer
from engine_ext import AdapterError, AsyncLLMEngine, EngineConfig, LLMEngine, PromptTooLongError, SamplingParams
from engine_ext import SpecConfig
from tiny_models import build_adapter, build_model

MODES = {"thread": False, "process": True}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    model = build_model("qwen2", str(root / "m"))
    text_model = add_char_tokenizer(build_model("llama", str(root / "t"), vocab_size=31))
    return model, build_adapter(model, str(root / "a"), seed=5, r=8), text_model


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return MODES[request.param]


@pytest.fixture(scope="module")
def aengine(paths, mode, one_torch_thread):
    engine = AsyncLLMEngine(EngineConfig(model=paths[0], num_kv_blocks=256, engine_process=mode))
    engine.add_adapter("a", paths[1])
    yield engine
    engine.shutdown()


def sync_engine(paths) -> LLMEngine:
    sync = LLMEngine(EngineConfig(model=paths[0], num_kv_blocks=256))
    sync.add_adapter("a", paths[1])
    return sync


def test_each_mode_runs_where_it_says(aengine, mode):
    import os

    assert (aengine.core_pid is not None and aengine.core_pid != os.getpid()) == mode
    assert aengine.is_alive()


def test_stream_matches_sync_generate(paths, aengine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def collect(prompt, adapter):
        chunks = []
        async for out in aengine.generate(prompt_token_ids=prompt, sampling_params=params, adapter_name=adapter):
            chunks.append(out)
        return chunks

    async def main():
        return await asyncio.gather(collect([1, 2, 3], "a"), collect([4, 5], None))

    streamed = asyncio.run(main())
    expected = sync_engine(paths).generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params,
                                           adapter_names=["a", None])
    for chunks, exp in zip(streamed, expected):
        assert len(chunks) > 1  # incremental, not one final blob
        assert [t for c in chunks for t in c.new_token_ids] == exp.token_ids == chunks[-1].token_ids
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])


def test_many_streams_on_two_loops_in_order_with_a_wakeup_per_step(paths, aengine):
    """16 streams on each of two event loops (threads): each stream's tokens are sync generate's, in order, and each
    loop is woken at most once per step for their outputs (the step's one message): handing each output over with
    its own wakeup cost the engine thread ~21 us an output (bench/async_host.py)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[i % 50 + 1, i % 7 + 2, 3] for i in range(32)]
    names = ["a" if i % 3 else None for i in range(32)]
    got, wakeups = {}, []

    def serve(half: int) -> None:
        async def collect(i):
            tokens = []
            async for out in aengine.generate(prompt_token_ids=prompts[i], sampling_params=params,
                                              adapter_name=names[i], request_id=f"loop{half}-{i}"):
                tokens += out.new_token_ids
            got[i] = tokens

        async def main():
            loop = asyncio.get_running_loop()
            call, count = loop.call_soon_threadsafe, [0]

            def counted(*a, **kw):
                count[0] += 1
                return call(*a, **kw)

            loop.call_soon_threadsafe = counted
            await asyncio.gather(*(collect(i) for i in range(half * 16, half * 16 + 16)))
            wakeups.append(count[0])

        asyncio.run(main())

    steps = aengine.stats()["num_steps"]
    threads = [threading.Thread(target=serve, args=(h,)) for h in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    steps = aengine.stats()["num_steps"] - steps
    expected = sync_engine(paths).generate(prompt_token_ids=prompts, sampling_params=params, adapter_names=names)
    assert [got.get(i) for i in range(32)] == [e.token_ids for e in expected]
    assert len(wakeups) == 2 and all(w <= steps for w in wakeups), (wakeups, steps)


def test_a_consumer_behind_the_engine_gets_the_outputs_it_missed_as_one(paths, aengine):
    """A stream read only after the engine has run ahead hands out every waiting output as one chunk: its new tokens
    and log-probabilities joined in order, as sync generate's; the last chunk the finished one."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)

    async def main():
        chunks = []
        async for out in aengine.generate(prompt_token_ids=[3, 1, 4], sampling_params=params, adapter_name="a"):
            chunks.append(out)
            if len(chunks) == 1:  # it runs to the end; the outputs the core sent before its last answer are
                while True:  # handed to this loop ahead of that answer, and reach the stream on the loop's next turn
                    stats = aengine.stats()
                    await asyncio.sleep(0.01)
                    if not (stats["num_running"] or stats["num_waiting"]):
                        break
        return chunks

    chunks = asyncio.run(main())
    (expected,) = sync_engine(paths).generate(prompt_token_ids=[[3, 1, 4]], sampling_params=params,
                                              adapter_names=["a"])
    # (one chunk, had the engine finished before the stream's first read; 40 without joining)
    assert len(chunks) <= 2 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert [t for c in chunks for t in c.new_token_ids] == expected.token_ids == chunks[-1].token_ids
    joined = [lp for c in chunks for lp in c.new_logprobs]
    assert [lp.token_id for lp in joined] == expected.token_ids
    assert [lp.logprob for lp in joined] == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
    assert [lp.top for lp in chunks[-1].logprobs][0][0][0] == expected.logprobs[0].top[0][0]


def test_abort_stops_the_stream(aengine):
    async def main():
        seen = 0
        stream = aengine.generate(prompt_token_ids=[1, 2], request_id="long",
                                  sampling_params=SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in stream:
            seen += len(out.new_token_ids)
            if seen >= 3:
                await aengine.abort("long")
            if out.finished:
                return out
        return None

    final = asyncio.run(main())
    assert final is not None and final.finish_reason == "abort" and len(final.token_ids) < 200
    assert aengine.stats()["num_running"] == 0


def test_a_consumer_that_leaves_aborts_its_request_in_the_core(aengine):
    async def main():
        stream = aengine.generate(prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=200,
                                                                                          ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # what Serve does when the HTTP client disconnects
        for _ in range(200):
            if not aengine.stats()["num_running"]:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_bad_request_raises_before_tokens_and_engine_still_serves(aengine):
    async def first(**kw):
        async for _ in aengine.generate(**kw):
            raise AssertionError("no output comes before the refusal")

    with pytest.raises(AdapterError, match="unknown adapter"):
        asyncio.run(first(prompt_token_ids=[1], adapter_name="missing"))
    with pytest.raises(PromptTooLongError) as refused:  # typed, with its numbers, from either mode's core
        asyncio.run(first(prompt_token_ids=[1] * 5000))
    assert refused.value.prompt_tokens == 5000

    async def good():
        return [o async for o in aengine.generate(prompt_token_ids=[3], sampling_params=SamplingParams(max_tokens=3,
                                                                                                   ignore_eos=True))]

    assert asyncio.run(good())[-1].finished


def test_adapters_are_mirrored_and_evicted_by_rank(paths, mode, one_torch_thread, tmp_path):
    """has_adapter and host_adapters answer from what the core last said, up to date when add/remove return; the
    host cache evicts by the ranks its client set (smallest first, None never)."""
    engine = AsyncLLMEngine(EngineConfig(model=paths[0], num_kv_blocks=64, max_loras=1, max_cpu_loras=2,
                                         engine_process=mode))
    try:
        names = ["x", "y", "z"]
        engine.rank_host_eviction({"x": None, "y": [1, 0.5]})
        for name in names[:2]:
            engine.add_adapter(name, paths[1])
        assert engine.has_adapter("x") and engine.host_adapters() == ["x", "y"]
        engine.add_adapter("z", paths[1])  # one must go: x is never evicted, y is ranked, z was just added
        assert engine.host_adapters() == ["x", "z"] and engine.has_adapter("y")  # registered: re-read on use
        engine.remove_adapter("x")
        assert not engine.has_adapter("x") and "x" not in engine.host_adapters()
        with pytest.raises(AdapterError):
            engine.add_adapter("bad", str(tmp_path))
    finally:
        engine.shutdown()


def test_stop_strings_are_applied_by_the_client_as_the_engine_does(paths, mode, one_torch_thread):
    """Text, stop strings and finish reasons streamed by the client are what a detokenizing LLMEngine gives: the
    core sends token ids only, and a stop string ends the request there (the core aborts the rest)."""
    params = dict(temperature=1.0, seed=11, ignore_eos=True, max_tokens=40)
    sync = LLMEngine(EngineConfig(model=paths[2], num_kv_blocks=256))
    free = sync.generate(prompts=["the quick brown fox"], sampling_params=SamplingParams(**params))[0]
    stop = free.text[10:13]
    (expected,) = sync.generate(prompts=["the quick brown fox"], sampling_params=SamplingParams(**params,
                                                                                               stop=[stop]))
    engine = AsyncLLMEngine(EngineConfig(model=paths[2], num_kv_blocks=256, engine_process=mode))

    async def main():
        return [o async for o in engine.generate("the quick brown fox", sampling_params=SamplingParams(
            **params, stop=[stop]))]

    try:
        chunks = asyncio.run(main())
        running = engine.stats()["num_running"]
    finally:
        engine.shutdown()
    final = chunks[-1]
    assert final.finish_reason == expected.finish_reason == "stop" and stop not in final.text
    assert final.text == expected.text == "".join(c.delta_text for c in chunks)
    assert final.token_ids == expected.token_ids and running == 0


def test_a_prompt_computed_in_a_drafting_pass_streams_its_first_token_before_the_cycle_ends(paths, mode,
                                                                                          one_torch_thread):
    """With speculation on, a new request's prompt runs in a cycle's drafting pass; its first token reaches the
    stream as soon as that pass has run (StepContext.publish: a message of its own), as a chunk of its own, before
    the rest of the cycle's tokens (which come together when the step is read), and the stream still equals plain
    decoding's."""
    engine = AsyncLLMEngine(EngineConfig(model=paths[0], num_kv_blocks=256, engine_process=mode,
                                         speculative=SpecConfig(num_draft_tokens=4, gate=False)))
    engine.add_adapter("a", paths[1])
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def collect(stream):
        return [out async for out in stream]

    async def main():
        # as long as the model's context allows (256), so it is still decoding when the new request reaches the core
        # (a core in its own process decodes on while this loop waits for the CPU); aborted once the new one is done
        background = engine.generate(prompt_token_ids=[1, 2], adapter_name="a", request_id="bg",
                                     sampling_params=SamplingParams(max_tokens=250, ignore_eos=True))
        await background.__anext__()  # it decodes: every step from now on is a 4-pass cycle
        # A request that reaches the core while it is between steps (reading one, scheduling the next) has its prompt
        # in the next cycle's first pass instead: new ones, one at a time, until one has ridden a drafting pass.
        for attempt in range(5):
            chunks = await collect(engine.generate(prompt_token_ids=[4, 5, 6], adapter_name="a",
                                                   request_id=f"new-{attempt}", sampling_params=params))
            if (await asyncio.to_thread(engine.stats))["speculative"]["ridden_prompts"]:
                break
        await engine.abort("bg")
        assert (await collect(background))[-1].finish_reason == "abort"  # it was still decoding throughout
        return chunks

    try:
        chunks = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    expected = sync_engine(paths).generate(prompt_token_ids=[[4, 5, 6]], sampling_params=params,
                                           adapter_names=["a"])[0]
    assert stats["speculative"]["ridden_prompts"] == 1  # the last new request's prompt, and only it
    assert len(chunks[0].new_token_ids) == 1 and len(chunks) > 1
    assert [t for c in chunks for t in c.new_token_ids] == expected.token_ids
