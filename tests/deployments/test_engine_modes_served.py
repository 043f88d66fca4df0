"""The engine core in a process of its own (the served default) serves what the core on a thread of the replica
serves, token for token, through the real data plane (LLMServer, the OpenAI app, the official `openai` client):
greedy and seeded sampled choices, streamed and not, stop strings, log-probabilities, and a stream its client
leaves. One data-plane kit per mode, the same requests sent to both."""

import pytest

from tests.deployments import data_plane_kit as K

MODES = ("thread", "process")


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    kits = {}
    try:
        for mode in MODES:
            kits[mode] = K.build(tmp_path_factory.mktemp(mode), engine={"engine_process": mode == "process"})
        yield kits
    finally:
        for kit in kits.values():
            K.close(kit)


def test_the_kits_run_one_mode_each(kits):
    assert kits["thread"].engine.core_pid is None and kits["process"].engine.core_pid is not None


def answer(kit, endpoint: str, stream: bool, **kw) -> list:
    """What a client sees of one request: per choice its text, finish reason and log-probabilities (the stream's
    deltas joined), and the usage."""
    async def go():
        client = kit.client()
        create = client.chat.completions.create if endpoint == "chat" else client.completions.create
        model = kw.pop("model", kit.base)
        if not stream:
            r = await create(model=model, **kw)
            choices = [(c.message.content if endpoint == "chat" else c.text, c.finish_reason,
                        c.logprobs.model_dump() if c.logprobs else None) for c in r.choices]
            return [sorted(choices, key=str), r.usage.completion_tokens]
        parts, finish, logprobs, usage = {}, {}, {}, None
        async for chunk in await create(model=model, stream=True, stream_options={"include_usage": True}, **kw):
            usage = chunk.usage.completion_tokens if chunk.usage else usage
            for c in chunk.choices:
                parts[c.index] = parts.get(c.index, "") + ((c.delta.content if endpoint == "chat" else c.text) or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
                if c.logprobs:  # joined over the chunks (how a stream is cut into chunks depends on timing)
                    joined = logprobs.setdefault(c.index, {})
                    for field, values in c.logprobs.model_dump().items():
                        if isinstance(values, list):
                            joined[field] = joined.get(field, []) + values
        return [sorted(((parts[i], finish[i], logprobs.get(i)) for i in parts), key=str), usage]

    return kit.run(go())


CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
CASES = {
    "completion-greedy-logprobs": ("completions", dict(prompt="def main():", max_tokens=24, temperature=0,
                                                       logprobs=3)),
    "chat-greedy-adapter": ("chat", dict(messages=CHAT, max_tokens=24, temperature=0, adapter=True)),
    "completion-sampled-n2": ("completions", dict(prompt="import os\n", max_tokens=24, temperature=0.9, top_p=0.95,
                                                  seed=7, n=2, adapter=True)),
    "chat-sampled-logprobs": ("chat", dict(messages=CHAT, max_tokens=16, temperature=0.8, seed=3, logprobs=True,
                                           top_logprobs=2)),
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_both_modes_serve_the_same_tokens(kits, case, stream):
    endpoint, kw = CASES[case]
    answers = [answer(kits[m], endpoint, stream, **with_model(kits[m], kw)) for m in MODES]
    assert answers[0] == answers[1]
    assert answers[0][1] > 0


def with_model(kit, kw: dict) -> dict:
    kw = dict(kw)
    if kw.pop("adapter", False):
        kw["model"] = kit.adapter
    return kw


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_stop_strings_end_both_at_the_same_token(kits, stream):
    """The client of a core process applies stop strings (the core sends token ids): where the text ends, and the
    completion tokens counted, are the in-process engine's."""
    kw = dict(messages=CHAT, max_tokens=40, temperature=0.9, seed=11)
    free = answer(kits["thread"], "chat", False, **kw)[0][0][0]
    assert len(free) > 14
    stop = free[8:12]
    answers = [answer(kits[m], "chat", stream, stop=[stop], **kw) for m in MODES]
    assert answers[0] == answers[1]
    (text, finish, _), = answers[0][0]
    assert finish == "stop" and text == free[: free.find(stop)]


def test_a_stream_its_client_leaves_is_the_same_and_ends_in_both_engines(kits):
    """The replica's stream closed after a few deltas (what Serve does when the HTTP client goes away): what came
    is the start of the same text in both modes, and each engine ends the request (its KV blocks free)."""
    from deployments.data_plane.protocol import GenerateRequest

    sampling = {"max_tokens": 200, "temperature": 0.0}

    async def first_deltas(kit):
        stream = kit.server.generate(GenerateRequest("left", None, sampling, prompt="def "))
        got = []
        async for chunk in stream:
            if chunk["type"] == "delta":
                got.append(chunk["text"])
                if len(got) == 4:
                    break
        await stream.aclose()
        return "".join(got)

    full = answer(kits["thread"], "completions", False, prompt="def ", max_tokens=200, temperature=0)[0][0][0]
    assert len(full) > 40  # long enough to be cut
    for kit in kits.values():
        before = idle_stats(kit)["base"]["tokens"]
        assert full.startswith(kit.run(first_deltas(kit)))
        stats = idle_stats(kit)
        assert stats["num_running"] == 0 and stats["free_kv_blocks"] == stats["total_kv_blocks"]
        assert stats["base"]["tokens"] - before < 100  # it ended where its client left, not at its end


def idle_stats(kit, attempts: int = 100) -> dict:
    import time

    for _ in range(attempts):
        stats = kit.engine.stats()
        if not stats["num_running"] and not stats["num_waiting"]:
            return stats
        time.sleep(0.05)
    return stats
