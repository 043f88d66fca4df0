"""KernelSettings: the Triton kernels' launch settings as one validated value, loaded from a dict (JSON) into
EngineConfig.kernels. Importable and checked without Triton."""

import json

import pytest

from engine_ext import EngineConfig, KernelSettings


def test_defaults_are_valid_and_frozen():
    s = KernelSettings()
    assert (s.attn_block_n, s.attn_stages, s.attn_rows, s.shrink_warps) == (128, 2, 16, 2)
    with pytest.raises(AttributeError):
        s.attn_block_n = 64


def test_from_dict_sets_the_named_fields_and_keeps_the_rest():
    s = KernelSettings.from_dict(json.loads('{"attn_block_n": 64, "silu_lora_warps": 4, "expand_block_n": 0}'))
    assert (s.attn_block_n, s.silu_lora_warps, s.expand_block_n) == (64, 4, 0)
    assert s.norm_chunk == KernelSettings().norm_chunk


@pytest.mark.parametrize("values,match", [
    ({"attn_blockn": 64}, r"unknown kernel settings \['attn_blockn'\]"),
    ({"attn_warps": 3}, "attn_warps must be a power of two in 1..32"),
    ({"shrink_warps": 0}, "shrink_warps must be a power of two"),
    ({"attn_block_n": 8}, "attn_block_n must be a power of two in 16"),
    ({"norm_chunk": 96}, "norm_chunk must be a power of two"),
    ({"expand_block_n": 24}, "expand_block_n must be 0 or a power of two"),
    ({"attn_rows": 8}, "attn_rows must be 0 or a power of two in 16"),
    ({"attn_max_splits": 3}, "attn_max_splits must be a power of two"),
    ({"attn_stages": -1}, "attn_stages must be >= 0"),
    ({"attn_split_budget": 0}, "attn_split_budget must be >= 1"),
    ({"attn_warps": 4.0}, "attn_warps must be an int"),
    ({"attn_warps": "4"}, "attn_warps must be an int"),
    ({"attn_warps": True}, "attn_warps must be an int"),
    ({"attn_rows_multi": 12}, "attn_rows_multi must be 0 or a power of two"),
    ({"fold_multi_token_ranks": -1}, "fold_multi_token_ranks must be >= 0"),
    ({"beside_lora_tokens": -1}, "beside_lora_tokens must be >= 0"),
    ({"beside_multi_token_ranks": -1}, "beside_multi_token_ranks must be >= 0"),
    ({"fold_multi_token_columns": -5}, "fold_multi_token_columns must be >= 0"),
    ({"fold_multi_layer_columns": -1}, "fold_multi_layer_columns must be >= 0"),
    ({"fold_multi_layer_max_rank": -1}, "fold_multi_layer_max_rank must be >= 0"),
    ({"triton_linear_tokens": -1}, "triton_linear_tokens must be >= 0"),
    ({"mixed_multi_tokens": -2}, "mixed_multi_tokens must be >= 0"),
    ({"fp8_gemv_tokens": 17}, "fp8_gemv_tokens must be in 0..16"),
    ({"fp8_gemv_block_n": 24}, "fp8_gemv_block_n must be a power of two"),
    ({"fold_decode_tokens": -1}, "fold_decode_tokens must be >= 0"),
    ({"multi_run_tokens": 0}, "multi_run_tokens must be >= 1"),
    ({"shrink_programs": 0}, "shrink_programs must be >= 1"),
])
def test_invalid_settings_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        KernelSettings.from_dict(values)


@pytest.mark.parametrize("zero_means_derived", ["norm_lora_bk", "silu_lora_sb", "expand_block_n", "attn_rows",
                                                "attn_stages"])
def test_zero_is_allowed_where_the_setting_is_derived(zero_means_derived):
    assert getattr(KernelSettings.from_dict({zero_means_derived: 0}), zero_means_derived) == 0


def test_engine_config_takes_settings_or_a_dict(tmp_path):
    assert EngineConfig(model=str(tmp_path)).kernels == KernelSettings()
    cfg = EngineConfig(model=str(tmp_path), kernels={"attn_block_n": 64})
    assert cfg.kernels == KernelSettings(attn_block_n=64)
    assert EngineConfig(model=str(tmp_path), kernels=KernelSettings(attn_warps=8)).kernels.attn_warps == 8
    with pytest.raises(ValueError, match="unknown kernel settings"):
        EngineConfig(model=str(tmp_path), kernels={"block_n": 64})
    with pytest.raises(ValueError, match="kernels must be a KernelSettings or a dict"):
        EngineConfig(model=str(tmp_path), kernels=[("attn_block_n", 64)])
