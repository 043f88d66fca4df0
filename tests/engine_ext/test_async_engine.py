"""AsyncLLMEngine: streaming tokens as they are produced, abort, and errors before the first token."""

import asyncio

import pytest

from engine_ext import AdapterError, AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from tiny_models import build_adapter, build_model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    model = build_model("qwen2", str(root / "m"))
    return model, build_adapter(model, str(root / "a"), seed=5, r=8)


@pytest.fixture(scope="module")
def aengine(paths):
    engine = AsyncLLMEngine(EngineConfig(model=paths[0], num_kv_blocks=256))
    engine.add_adapter("a", paths[1])
    yield engine
    engine.shutdown()


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
    sync = LLMEngine(EngineConfig(model=paths[0], num_kv_blocks=256))
    sync.add_adapter("a", paths[1])
    expected = sync.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=params, adapter_names=["a", None])
    for chunks, exp in zip(streamed, expected):
        assert len(chunks) > 1  # incremental, not one final blob
        assert [t for c in chunks for t in c.new_token_ids] == exp.token_ids
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])


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


def test_bad_request_raises_before_tokens_and_engine_still_serves(aengine):
    async def bad():
        async for _ in aengine.generate(prompt_token_ids=[1], adapter_name="missing"):
            pass

    with pytest.raises(AdapterError, match="unknown adapter"):
        asyncio.run(bad())

    async def good():
        return [o async for o in aengine.generate(prompt_token_ids=[3], sampling_params=SamplingParams(max_tokens=3,
                                                                                                   ignore_eos=True))]

    assert asyncio.run(good())[-1].finished
