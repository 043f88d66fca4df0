"""The kernels an engine runs are chosen once from its EngineConfig (backend.Backend) and the model is built
with its element-wise ops; only ops that take LoRA math do, folded into decode and verify-sized forwards, beside the products in larger ones."""

from types import SimpleNamespace

import pytest
import torch

from engine_ext import EngineConfig, KernelSettings
from engine_ext.backend import Backend
from engine_ext.batch import TORCH_METADATA, advance_forward, apply_sources
from engine_ext.lora_ops import add_lora_dense, add_lora_reference
from engine_ext.model import CausalLM, TorchOps
from engine_ext.model_config import ModelSpec, RopeSpec

SPEC = ModelSpec(architecture="LlamaForCausalLM", vocab_size=31, hidden_size=32, intermediate_size=48, num_layers=2,
                 num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(theta=1e4),
                 tie_word_embeddings=True, max_position_embeddings=64, sliding_windows=(None,) * 2,
                 eos_token_ids=(0,))
GROUPED = SimpleNamespace(groups={}, rank=16)  # a rank-16 LoRABatch with the slots' fused group stacks
GROUPED64 = SimpleNamespace(groups={}, rank=64)


@pytest.mark.parametrize("lora_backend,op", [("torch", add_lora_dense), ("gather", add_lora_reference)])
def test_the_plain_torch_backend(tmp_path, lora_backend, op):
    backend = Backend.from_config(EngineConfig(model=str(tmp_path), lora_backend=lora_backend), torch.device("cpu"))
    assert isinstance(backend.layer_ops, TorchOps)
    assert backend.lora_op is op and backend.group_lora_op is None and backend.attention is None
    assert backend.metadata is TORCH_METADATA
    assert TORCH_METADATA.apply_sources is apply_sources and TORCH_METADATA.advance_forward is advance_forward


def test_torch_ops_never_take_lora_math():
    model = CausalLM(SPEC, torch.float32, TorchOps())
    assert model.lora_path(GROUPED, 1, False) == "after"
    assert model.lora_path(GROUPED, 8, True) == "after"


COLUMNS = 32 + 16 + 16 + 32 + 48 + 48 + 32  # SPEC's q, k, v, o, gate, up and down widths


def test_the_model_passes_its_layers_lora_columns():
    assert CausalLM(SPEC, torch.float32, TorchOps()).lora_columns == COLUMNS


class _FoldingOps(TorchOps):
    """Ops that take LoRA by the Triton ops' rule (KernelSettings.lora_path): verify forwards folded up to 1,024
    tokens x rank (64 tokens at rank 16, 16 at rank 64) and 48 tokens' columns, beside the products up to 2,048
    tokens x rank; decode steps beside the products up to 96 tokens."""

    fuses_lora = True

    @staticmethod
    def lora_path(num_tokens, multi, rank, columns):
        assert columns == COLUMNS
        settings = KernelSettings(fold_multi_token_ranks=1024, fold_multi_token_columns=48 * COLUMNS,
                                  beside_multi_token_ranks=2048, beside_lora_tokens=96)
        return settings.lora_path(num_tokens, multi, rank, columns)


@pytest.mark.parametrize("lora,tokens,multi,path", [
    (GROUPED, 4, False, "fold"),  # decode
    (GROUPED, 32, False, "fold"),
    (GROUPED, 33, False, "beside"),  # decode past one wave of programs: each delta beside its product
    (GROUPED, 97, False, "after"),  # past beside_lora_tokens: the group op after each product
    (GROUPED, 10, True, "fold"),  # a verify pass (several tokens of a sequence)
    (GROUPED, 48, True, "fold"),
    (GROUPED, 49, True, "beside"),  # past fold_multi_token_columns (tokens x the layer's LoRA columns)
    (GROUPED, 128, True, "beside"),
    (GROUPED, 129, True, "after"),  # past beside_multi_token_ranks
    (GROUPED, 4096, True, "after"),  # a long prefill
    (GROUPED64, 16, True, "fold"),  # a higher rank folds fewer tokens...
    (GROUPED64, 17, True, "beside"),  # past fold_multi_token_ranks
    (GROUPED64, 32, True, "beside"),
    (GROUPED64, 33, True, "after"),  # ...and puts fewer beside the products
    (GROUPED64, 32, False, "fold"),  # decode's bound does not depend on the rank
    (SimpleNamespace(groups=None), 1, False, "after"),  # no fused group stacks to pass
    (None, 1, False, "after"),  # no adapters in the batch
])
def test_lora_taking_ops_fold_decode_and_verify_sized_forwards_and_put_larger_ones_beside_the_products(
        lora, tokens, multi, path):
    model = CausalLM(SPEC, torch.float32, _FoldingOps())
    assert model.lora_path(lora, tokens, multi) == path


def test_the_default_paths_at_the_measured_shapes():
    """KernelSettings' defaults at the Llama-3.2-1B (23,552 LoRA columns a layer) and 3.1-8B (43,008) shapes, batch 32
    with k = 1..4 drafts (bench/RESULTS.md section 1): rank 16 folds up to 96 tokens at 1B, beside the products past
    them, and goes beside them at every size at 8B (a layer wider than fold_multi_layer_columns); rank 64 folds 64
    tokens at both (past fold_multi_layer_max_rank), the kernels after the products past them; decode folds to 32."""
    s = KernelSettings()
    assert [s.lora_path(32 * (k + 1), True, 16, 23552) for k in range(1, 5)] == ["fold", "fold", "beside", "beside"]
    assert [s.lora_path(32 * (k + 1), True, 16, 43008) for k in range(1, 5)] == ["beside"] * 4
    assert [s.lora_path(8 * (k + 1), True, 16, 43008) for k in range(1, 5)] == ["beside"] * 4
    assert [s.lora_path(8 * (k + 1), True, 16, 23552) for k in range(1, 5)] == ["fold"] * 4
    assert [s.lora_path(32 * (k + 1), True, 64, 23552) for k in range(1, 5)] == ["fold", "after", "after", "after"]
    assert [s.lora_path(32 * (k + 1), True, 64, 43008) for k in range(1, 5)] == ["fold", "after", "after", "after"]
    assert [s.lora_path(8 * (k + 1), True, 64, 43008) for k in range(1, 5)] == ["fold"] * 4
    assert s.lora_path(32, False, 16, 43008) == "fold" and s.lora_path(33, False, 16, 43008) == "after"


def test_mixed_takes_unfolded_multi_token_forwards_within_its_tokens_and_the_fold_rank_bound():
    s = KernelSettings(mixed_multi_tokens=160)
    assert [s.lora_path(32 * (k + 1), True, 16, 23552) for k in range(1, 6)] == [
        "fold", "fold", "mixed", "mixed", "beside"]  # 192 tokens: past mixed_multi_tokens
    assert s.lora_path(32, False, 16, 23552) == "fold" and s.lora_path(64, False, 16, 23552) == "after"
    assert s.lora_path(96, True, 64, 23552) == "after"  # past beside_multi_token_ranks
    wide = KernelSettings(mixed_multi_tokens=160, beside_multi_token_ranks=1 << 20)
    assert wide.lora_path(96, True, 64, 23552) == "beside"  # past fold_multi_token_ranks: attention cannot fold
    assert KernelSettings().lora_path(128, True, 16, 23552) == "beside"  # off by default


def test_zero_bounds_keep_unfolded_forwards_after_the_products():
    settings = KernelSettings(fold_multi_token_ranks=0, beside_multi_token_ranks=0)
    assert settings.lora_path(5, True, 16, 100) == "after"
    assert KernelSettings(fold_multi_token_ranks=0).lora_path(5, True, 16, 100) == "beside"
    assert KernelSettings(fold_multi_token_columns=0).lora_path(5, True, 16, 100) == "beside"
    assert KernelSettings(fold_multi_layer_columns=99).lora_path(5, True, 16, 100) == "beside"
    # past the layer bound's rank: folds on any layer
    assert KernelSettings(fold_multi_layer_columns=99).lora_path(5, True, 17, 100) == "fold"
    assert KernelSettings(fold_multi_layer_columns=99, fold_multi_layer_max_rank=0).lora_path(5, True, 1, 100) == "fold"
    assert KernelSettings(fold_multi_layer_columns=0).lora_path(5, True, 16, 50000) == "fold"  # no layer bound
    assert KernelSettings(fold_decode_tokens=0, beside_lora_tokens=5).lora_path(5, False, 16, 100) == "beside"
