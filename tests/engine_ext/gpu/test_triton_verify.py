"""A cycle's commit in one launch (kernels/triton_verify.py) against speculation/verify.commit_rows on the GPU:
random commit lanes (commit_cases.py), rows with and without drafts, partial acceptance, rows that do not verify."""

import pytest
import torch

from commit_cases import check_commit_kernel

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_the_commit_kernel_matches_the_reference():
    from engine_ext.kernels.triton_verify import commit_rows_triton

    assert check_commit_kernel(commit_rows_triton, torch.device("cuda")) > 50
