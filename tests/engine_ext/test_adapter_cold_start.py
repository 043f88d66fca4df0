"""A request for an adapter that is in no device slot, arriving at an idle engine: its adapter's copy into a slot
starts although the step that activated it queues no forward, and the request finishes. On a GPU the copy runs on a
side stream and is issued after a step's forward, so that its host time overlaps the device's work; with no forward
to follow it must still be issued, or the request waits for it forever (the CUDA run of this test once did)."""

import time

from engine_ext import EngineConfig, LLMEngine, SamplingParams
from tiny_models import build_adapter, build_model


def test_an_adapter_request_alone_on_an_idle_engine_finishes(tmp_path, backend):
    model = build_model("llama", str(tmp_path / "m"))
    engine = LLMEngine(EngineConfig(model=model, max_loras=1, block_size=4, num_kv_blocks=64, debug_checks=True,
                                    **backend))
    for name, seed in (("a", 1), ("b", 2)):
        engine.add_adapter(name, build_adapter(model, str(tmp_path / name), seed=seed, r=8))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # each alone, its adapter not in the one slot (b's copy evicts a's)
    for rid, adapter in (("first", "a"), ("then", "b"), ("again", "a")):
        engine.add_request(rid, prompt_token_ids=[3, 4, 5], sampling_params=params, adapter_name=adapter)
        # Bounded in time, not steps: a copy never issued leaves the request waiting forever, while one that lands
        # late (the GPU shared with other test processes) may outlast any number of an idle engine's fast steps.
        done, deadline = [], time.monotonic() + 60
        while engine.has_unfinished_requests and time.monotonic() < deadline:
            done += [out for out in engine.step() if out.finished]
        assert [out.request_id for out in done] == [rid] and len(done[0].token_ids) == 4
