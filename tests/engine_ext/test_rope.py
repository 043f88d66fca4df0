"""Rotary tables: CausalLM.build_rope_table precomputes cos/sin over positions, and the forward reads each
token's rows by position; the same bits as computing them per step (cos_sin), and the same logits."""

import torch

from engine_ext.model import TorchOps
from engine_ext.model_config import RopeSpec
from engine_ext.rope import cos_sin, inv_frequencies


def test_table_rows_are_the_per_step_values_bit_for_bit():
    spec = RopeSpec(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    inv = inv_frequencies(spec, 64)
    positions = torch.tensor([0, 1, 4095, 17, 8191, 3, 3])
    for dtype in (torch.float32, torch.bfloat16):
        table = cos_sin(inv, torch.arange(8192), dtype)
        per_step = cos_sin(inv, positions, dtype)
        assert torch.equal(table[0][positions], per_step[0]) and torch.equal(table[1][positions], per_step[1])


def test_torch_ops_rope_reads_tables_by_position():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 4, 2, 16
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g)
    positions = torch.tensor([7, 0, 3, 3, 11])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    caches = [torch.zeros(4, 4, kv_heads, d) for _ in range(4)]
    slots = torch.tensor([0, 5, 6, 9, 15])
    ref = TorchOps.rope_write_kv(qkv.clone(), *cos_sin(inv, positions, torch.float32), caches[0], caches[1], slots,
                                 heads, kv_heads)
    got = TorchOps.rope_write_kv(qkv.clone(), *cos_sin(inv, torch.arange(12), torch.float32), caches[2], caches[3],
                                 slots, heads, kv_heads, positions=positions)
    assert torch.equal(got, ref) and torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_forward_with_the_table_gives_the_per_step_logits(tmp_path):
    """The runner builds the table; a forward without it (per-step cos_sin) gives the same logits."""
    from tiny_models import build_model

    from engine_ext import EngineConfig, LLMEngine
    from engine_ext.batch import SeqWork

    engine = LLMEngine(EngineConfig(model=build_model("llama", str(tmp_path / "m")), block_size=4, num_kv_blocks=32))
    runner, slots = engine.runner, engine.adapters.slots
    assert runner.model.rope_table[0].shape[0] == runner.max_positions
    work = [SeqWork([1, 2, 3, 4, 5, 6], 0, [0, 1], slots.zero_slot, num_logits=6),
            SeqWork([9, 8, 7], 0, [2], slots.zero_slot, num_logits=2)]
    with_table = runner.run(work, slots)
    runner.model.rope_table = None
    per_step = runner.run(work, slots)
    assert with_table.dtype == torch.float32 and with_table.shape[0] == 8
    assert torch.equal(with_table, per_step)
