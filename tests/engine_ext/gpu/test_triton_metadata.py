"""The metadata fix-ups in Triton (kernels/triton_metadata.py) equal batch.apply_sources and batch.advance_forward
exactly, compile once for any batch, and are what layer_ops "triton" picks."""

import pytest
import torch

import metadata_cases as cases

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"


def test_apply_sources_equals_the_reference():
    """Token sources with -1 among them, shifts, both and neither; one token to several programs' worth; the
    column slice of a wider buffer (a graph's rows[:, :bucket]) leaves the columns past it alone."""
    from engine_ext.kernels.triton_metadata import apply_sources_triton

    assert cases.check_apply_sources(apply_sources_triton, DEV) == len(cases.SOURCES) * len(cases.SIZES)


def test_advance_forward_equals_the_reference():
    """Rows of one packed buffer and separate tensors, from token 0 of the buffer and from a later one."""
    from engine_ext.kernels.triton_metadata import advance_forward_triton

    assert cases.check_advance_forward(advance_forward_triton, DEV) == 4 * len(cases.SIZES)
    cases.check_advance_refuses_short_tokens(advance_forward_triton, DEV)


def test_each_kernel_compiles_one_variant_for_any_batch():
    """Token counts, strides, `start` and which sources are given are runtime arguments: the kernels warm-up compiles
    (ModelRunner._warm_metadata) serve every later forward."""
    from engine_ext.kernels import triton_metadata as tm

    cases.check_apply_sources(tm.apply_sources_triton, DEV)
    cases.check_advance_forward(tm.advance_forward_triton, DEV)
    device = torch.cuda.current_device()
    for kernel in (tm._apply_sources_kernel, tm._advance_forward_kernel):
        assert len(kernel.device_caches[device][0]) == 1


def test_no_host_sync():
    """Neither launch waits for the device (CUDA's sync debug mode raises on a synchronising call)."""
    from engine_ext.kernels.triton_metadata import advance_forward_triton, apply_sources_triton

    rows = torch.zeros(9, 32, dtype=torch.long, device=DEV)
    tables = torch.zeros(2, 4, dtype=torch.long, device=DEV)
    tokens = torch.zeros(40, dtype=torch.long, device=DEV)
    apply_sources_triton(rows, tables, 4, tokens, tokens)  # compiled before the sync check
    advance_forward_triton(rows[0], rows[1], rows[2], rows[3], tables, 4, tokens, 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_sources_triton(rows[:, :16], tables, 4, tokens, tokens)
        advance_forward_triton(rows[0, :16], rows[1, :16], rows[2, :16], rows[3, :16], tables, 4, tokens, 8)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_layer_ops_triton_picks_the_kernels(tmp_path):
    from engine_ext import EngineConfig
    from engine_ext.backend import Backend
    from engine_ext.batch import TORCH_METADATA
    from engine_ext.kernels.triton_metadata import advance_forward_triton, apply_sources_triton

    fused = Backend.from_config(EngineConfig(model=str(tmp_path), device=DEV, layer_ops="triton"), torch.device(DEV))
    assert fused.metadata.apply_sources is apply_sources_triton
    assert fused.metadata.advance_forward is advance_forward_triton
    plain = Backend.from_config(EngineConfig(model=str(tmp_path), device=DEV, lora_backend="triton",
                                             attn_backend="triton"), torch.device(DEV))
    assert plain.metadata is TORCH_METADATA
