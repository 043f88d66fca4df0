"""A speculative run needs KV blocks only for the k lookahead positions beyond plain decoding."""

from engine_ext import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine_ext.block_manager import blocks_for
from tiny_models import build_adapter, build_model

K, BLOCK, PROMPT_LEN, MAX_TOKENS = 4, 4, 5, 20
PROMPTS = [[i + 1] * PROMPT_LEN for i in range(4)]
NAMES = ["a", "a", None, "a"]
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def run(model, adapter, blocks, spec):
    engine = LLMEngine(EngineConfig(model=model, block_size=BLOCK, num_kv_blocks=blocks, speculative=spec))
    engine.add_adapter("a", adapter)
    outs = engine.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, adapter_names=NAMES)
    return [o.token_ids for o in outs], engine


def test_cache_filled_to_its_limit(tmp_path):
    model = build_model("llama", str(tmp_path / "m"))
    adapter = build_adapter(model, str(tmp_path / "a"), seed=1, r=8, std=0.03,
                            target_modules=("q_proj", "v_proj", "gate_proj"))
    # Plain decoding holds at most prompt + max_tokens - 1 positions per sequence; speculation adds the
    # k drafted positions and nothing else.
    plain_need = blocks_for(PROMPT_LEN + MAX_TOKENS - 1, BLOCK)
    spec_need = blocks_for(PROMPT_LEN + MAX_TOKENS - 1 + K, BLOCK)
    assert spec_need == plain_need + 1

    expected, plain = run(model, adapter, plain_need * len(PROMPTS), None)
    assert plain.stats()["num_preemptions"] == 0
    assert plain.blocks.peak_used == plain_need * len(PROMPTS)

    limit = spec_need * len(PROMPTS)
    got, spec = run(model, adapter, limit, SpecConfig(num_draft_tokens=K, gate=False))
    assert got == expected
    stats = spec.stats()
    assert stats["num_preemptions"] == 0 and stats["speculative"]["draft_passes"] > 0
    assert spec.blocks.peak_used == limit  # the cache was filled to the block, and that was enough
    assert stats["free_kv_blocks"] == limit

    # One block less than that and some sequence must wait or be preempted, yet output is unchanged.
    got, tight = run(model, adapter, limit - 1, SpecConfig(num_draft_tokens=K, gate=False))
    assert got == expected and tight.stats()["num_preemptions"] > 0
