"""The engine backends a suite runs on, as EngineConfig fields: `EngineConfig(model=..., **backend)`.

A suite that should hold on every backend asks for the `backend` fixture (conftest.py), which runs it on
BACKENDS: the plain-torch engine on the CPU (always) and the Triton kernels with CUDA graphs on a GPU (marked
`gpu`, skipped where CUDA or Triton is missing). One test that needs other backends overrides the list:
`@pytest.mark.parametrize("backend", [param(CUDA_TRITON, "cuda-triton")], indirect=True)`; a suite over other
backends for all its tests defines its own `backend` fixture over them (test_speculative_greedy.py: WITH_FP8)."""

import pytest
import torch

CPU_TORCH: dict = {}  # the plain-torch kernels, eager: every default
CUDA_TORCH = dict(device="cuda")
CUDA_TRITON = dict(device="cuda", lora_backend="triton", attn_backend="triton", layer_ops="triton")  # the kernels, eager
CUDA_TRITON_GRAPHS = dict(CUDA_TRITON, cuda_graphs=True, max_graph_tokens=64)  # the serving configuration
CPU_FP8 = dict(quantization="fp8")  # FP8 base weights through the plain-torch reference (engine_ext/quantization.py)
CUDA_FP8 = dict(CUDA_TRITON_GRAPHS, quantization="fp8")  # FP8 base weights through the W8A16 GEMM (kernels/triton_fp8.py)


def on_gpu(backend: dict) -> bool:
    return backend.get("device", "cpu").startswith("cuda")


def param(backend: dict, id: str):
    """A pytest param for `backend`, marked `gpu` when it runs on a CUDA device."""
    return pytest.param(backend, id=id, marks=[pytest.mark.gpu] if on_gpu(backend) else [])


BACKENDS = [param(CPU_TORCH, "cpu-torch"), param(CUDA_TRITON_GRAPHS, "cuda-triton-graphs")]
# For suites whose claim must hold whatever the base weights are (speculation is lossless): BACKENDS and the FP8 engine
WITH_FP8 = BACKENDS + [param(CPU_FP8, "cpu-fp8"), param(CUDA_FP8, "cuda-fp8-graphs")]


def skip_unless_available(backend: dict) -> None:
    if on_gpu(backend):
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        if "triton" in (backend.get("lora_backend"), backend.get("attn_backend"), backend.get("layer_ops")):
            pytest.importorskip("triton")
