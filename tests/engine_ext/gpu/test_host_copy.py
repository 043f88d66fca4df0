"""Step metadata read by a kernel from pinned host memory (EngineConfig.graph_inputs="mapped")."""

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("shape,dtype", [((9, 640), torch.long), ((33, 128), torch.long), ((3,), torch.int32),
                                         ((0, 4), torch.long), ((5000,), torch.float32)])
def test_copies_exactly(shape, dtype):
    from engine_ext.kernels.host_copy import copy_from_pinned

    src = (torch.randn(shape) * 1e6).to(dtype).pin_memory()
    dst = torch.full(shape, -7, dtype=dtype, device="cuda")
    copy_from_pinned(dst, src)
    assert torch.equal(dst.cpu(), src)


def test_refuses_what_it_cannot_read():
    from engine_ext.kernels.host_copy import copy_from_pinned

    dst = torch.zeros(8, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match="pinned"):
        copy_from_pinned(dst, torch.zeros(8, dtype=torch.long))  # pageable
    with pytest.raises(ValueError, match="shape and dtype"):
        copy_from_pinned(dst, torch.zeros(9, dtype=torch.long).pin_memory())
    with pytest.raises(ValueError, match="contiguous"):
        copy_from_pinned(torch.zeros(8, 2, dtype=torch.long, device="cuda").t(),
                         torch.zeros(2, 8, dtype=torch.long).pin_memory().t())


def test_does_not_queue_behind_a_copy_engine_transfer():
    """The reason for it: a large host-to-device copy on a side stream (an adapter load) is still running
    when the kernel's copy on the compute stream has finished; stream order on the compute stream holds."""
    from engine_ext.kernels.host_copy import copy_from_pinned

    big_src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    big_dst = torch.empty_like(big_src, device="cuda")
    side = torch.cuda.Stream()
    small_src = torch.arange(9 * 640, dtype=torch.long).view(9, 640).pin_memory()
    small_dst = torch.zeros(9, 640, dtype=torch.long, device="cuda")
    copy_from_pinned(small_dst, small_src)  # compiled before the timing
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        big_dst.copy_(big_src, non_blocking=True)  # ~20 ms over PCIe
        big_done = torch.cuda.Event()
        big_done.record()
    small_dst.zero_()
    copy_from_pinned(small_dst, small_src)
    out = small_dst.sum()  # ordered after the copy on the compute stream
    small_done = torch.cuda.Event()
    small_done.record()
    small_done.synchronize()
    assert not big_done.query()
    assert out.item() == small_src.sum().item()
    torch.cuda.synchronize()
