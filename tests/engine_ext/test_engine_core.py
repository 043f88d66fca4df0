"""The engine core's process and its boundary: messages that cross it as plain data, what happens when the core or
its client dies, a core that cannot start, and the host cache's eviction order by rank."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine_ext import AsyncLLMEngine, EngineConfig, EngineDeadError, ModelLoadError, SamplingParams, SpecConfig
from engine_ext.core.eviction_order import HostEvictionOrder
from engine_ext.core.messages import (AddRequest, Refused, Reply, StepOutputs, decode, encode, error_of,
                                      wire_error)
from engine_ext.errors import InvalidParameterError, PromptTooLongError
from engine_ext.lora_adapter import AdapterError
from tiny_models import build_adapter, build_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("llama", str(tmp_path_factory.mktemp("core") / "m"))


@pytest.mark.parametrize("message", [
    AddRequest("r1", [1, 2, 3], {"max_tokens": 4, "logit_bias": {7: 1.5}, "stop": []}, "a@1", None),
    StepOutputs(["r1", "r2"], [1, 2], [5, 6, 7], [[1, "length"]], [[0, [-0.5], [[5, 9]], [[-0.5, -2.0]]]],
                [[1, b"\0" * 8, [1, 2]]]),
    Refused("r3", wire_error(PromptTooLongError("too long", 500, 256))),
    Reply(4, {"num_running": 0, "adapters": {"a@1": {"tokens": 3}}, "cycle_passes": {1: 2}}, None),
])
def test_messages_cross_as_plain_data(message):
    assert decode(encode(message)) == message


@pytest.mark.parametrize("error", [
    PromptTooLongError("prompt has 500 tokens", 500, 256), InvalidParameterError("logit_bias", "out of range"),
    AdapterError("a@1", "rank 128 exceeds max_lora_rank 64"), ModelLoadError("no weights"),
    FileNotFoundError("model directory not found"), ValueError("max_tokens must be >= 1"),
])
def test_errors_cross_typed(error):
    back = error_of(decode(encode(Refused("r", wire_error(error)))).error)
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)
    assert getattr(back, "prompt_tokens", None) == getattr(error, "prompt_tokens", None)


def test_other_errors_cross_as_runtime_errors_naming_their_type():
    back = error_of(wire_error(KeyError("boom")))
    assert type(back) is RuntimeError and "KeyError" in str(back)


@pytest.mark.parametrize("ranks, candidates, victim", [
    ({}, ["a", "b"], "a"),  # nothing ranked: least recently used
    ({"a": [2.0], "b": [1.0]}, ["a", "b"], "b"),  # smallest rank
    ({"a": [1, 5.0], "b": [0, 9.0]}, ["a", "b"], "b"),  # compared as tuples
    ({"a": None, "b": None}, ["a", "b"], None),  # never evicted
    ({"a": [0.0]}, ["a", "b"], "b"),  # never ranked: before every ranked one
    ({"a": None, "b": [3.0]}, ["a", "b"], "b"),
])
def test_host_eviction_order(ranks, candidates, victim):
    order = HostEvictionOrder()
    order.rank({"a": None, "b": None, "c": [0.0]})  # replaced below
    order.rank(ranks, replace=True)
    assert order.choose(candidates) == victim


def _stream_all(engine, n, tokens):
    """n streams at once; -> (outcome per stream: "ok" or the exception, seconds from `killed` to each end)."""
    ends, outcomes = [], []

    async def one(i):
        try:
            async for _ in engine.generate(prompt_token_ids=[i + 1, 2], sampling_params=SamplingParams(
                    max_tokens=tokens, ignore_eos=True)):
                pass
            outcomes.append("ok")
        except Exception as e:  # noqa: BLE001 - what the test looks at
            outcomes.append(e)
        ends.append(time.monotonic())

    async def main():
        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        while not engine.stats()["num_running"]:
            await asyncio.sleep(0.01)
        killed = time.monotonic()
        os.kill(engine.core_pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)  # nothing hangs
        return killed

    killed = asyncio.run(main())
    return outcomes, [end - killed for end in ends]


def test_a_killed_core_ends_every_stream_with_an_error_within_2s(model, one_torch_thread):
    engine = AsyncLLMEngine(EngineConfig(model=model, num_kv_blocks=512, max_model_len=1024, engine_process=True))
    try:
        outcomes, seconds = _stream_all(engine, 16, tokens=900)
        assert all(isinstance(o, EngineDeadError) for o in outcomes), outcomes
        assert max(seconds) < 2.0, seconds
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError):  # and what comes later is refused at once
            asyncio.run(_first(engine))
        with pytest.raises(EngineDeadError):
            engine.stats()
    finally:
        engine.shutdown()


async def _first(engine):
    async for out in engine.generate(prompt_token_ids=[1]):
        return out


def test_a_core_exits_with_its_client(model):
    """The client's process killed: its core sees stdin close and exits (no orphan holding the device)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = {sys.path!r}
        from engine_ext import AsyncLLMEngine, EngineConfig
        engine = AsyncLLMEngine(EngineConfig(model={model!r}, num_kv_blocks=64, engine_process=True))
        print(engine.core_pid, flush=True)
        time.sleep(600)
    """)
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core = int(client.stdout.readline())
        client.kill()
        client.wait()
        deadline = time.monotonic() + 10
        while _running(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(core)
    finally:
        client.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_core_that_cannot_start_raises_its_engines_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError):
        AsyncLLMEngine(EngineConfig(model=str(tmp_path), engine_process=True))


async def _generate(engine, n: int, tokens: int, adapter: str | None = None) -> list[list[int]]:
    async def one(i):
        out = None
        async for out in engine.generate(prompt_token_ids=[i + 1, 2, 3], sampling_params=SamplingParams(
                max_tokens=tokens, ignore_eos=True), adapter_name=adapter):
            pass
        return list(out.token_ids)

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("engine_process", [True, False])
def test_speculation_set_and_device_profiled_where_the_core_runs(model, tmp_path, one_torch_thread, engine_process):
    """SetSpeculation and Profile through either core: drafting switched on and off between runs (outputs exact
    either way), and the core's own operators recorded (a profiler in this process sees none of a core process's)."""
    engine = AsyncLLMEngine(EngineConfig(model=model, num_kv_blocks=256, max_model_len=256, speculative=SpecConfig(2),
                                         engine_process=engine_process))
    try:
        engine.add_adapter("a", build_adapter(model, str(tmp_path / "a"), seed=3, r=8))
        assert "speculative" in engine.stats()  # EngineConfig.speculative: drafting on at start
        engine.set_speculation(None)
        assert "speculative" not in engine.stats()
        plain = asyncio.run(_generate(engine, 3, 8, "a"))
        engine.set_speculation(SpecConfig(num_draft_tokens=2, gate=False))
        engine.start_profile(breakdown=True)
        with pytest.raises(ValueError, match="already"):
            engine.start_profile()
        drafted = asyncio.run(_generate(engine, 3, 8, "a"))
        profile = engine.stop_profile()
        assert drafted == plain
        spec = engine.stats()["speculative"]
        assert spec["cycles"] > spec["plain_steps"]  # forced: every step a cycle but the prompts' 
        assert profile["device"] == "cpu" and profile["kernels"] > 0
        assert 0 < profile["kernel_seconds"] <= profile["span_seconds"] + 1e-6
        assert {"idle_gaps", "top_kernels"} <= set(profile)
        assert any("linear" in k["kernel"] or "mm" in k["kernel"] for k in profile["top_kernels"])
        with pytest.raises(ValueError, match="no profile"):
            engine.stop_profile()
        with pytest.raises(ValueError, match="exceeds"):  # the drafting room the engine was built with
            engine.set_speculation(SpecConfig(num_draft_tokens=5))
        engine.set_speculation(None)
        assert "speculative" not in engine.stats()
        assert asyncio.run(_generate(engine, 3, 8, "a")) == plain
    finally:
        engine.shutdown()
