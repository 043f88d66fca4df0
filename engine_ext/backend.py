"""The kernels an engine runs, chosen once from its EngineConfig: the model is built with `layer_ops`, the
model runner (and its CUDA graphs) pass the LoRA ops and the attention kernel to every forward.

Each choice is "torch" (the plain-torch references, any device) or "triton" (the GPU kernels, launched with
the config's KernelSettings):
- lora_backend: the batched LoRA op, and for "triton" also the one-launch op of a fused q/k/v or gate/up
  group ("gather": the per-token torch reference);
- attn_backend: paged attention;
- layer_ops: the decoder layer's element-wise work (norms, rotary + KV write, SiLU); "triton" fuses it and,
  with lora_backend "triton" too, folds the LoRA math of graph-sized forwards (decode steps, drafting and verify
  passes) into the same kernels. It also picks the forward's metadata fix-ups on the device (batch.MetadataOps:
  apply_sources and advance_forward) and a cycle's commit (speculation/verify.commit_rows), one Triton launch
  each (kernels/triton_metadata.py, kernels/triton_verify.py) instead of a dozen small torch ops;
- quantization: the decoder layers' product weights, dense or FP8 (quantization.py); FP8 products run the W8A16
  GEMM of kernels/triton_fp8.py with layer_ops "triton", else the plain-torch reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .batch import TORCH_METADATA, MetadataOps
from .config import EngineConfig
from .lora_ops import LoRAOp, get_lora_op
from .model import LayerOps, TorchOps
from .quantization import WeightFormat, weight_format
from .speculation.verify import commit_rows


@dataclass(frozen=True)
class Backend:
    layer_ops: LayerOps
    lora_op: LoRAOp
    # op(y, x, A [S, in, nseg*R], B [S, R, out_total], scale [S, nseg], slots, segment starts), or None: each
    # module of a fused group is applied with lora_op on its column slice
    group_lora_op: Callable | None
    attention: Callable | None  # AttnMetadata.kernel; None: attention.paged_attention's torch reference
    # The decoder layers' product weights (quantization.py): dense (layer_ops.linear), or FP8 with its matmul, refused
    # here on a GPU without FP8 support
    weights: WeightFormat
    metadata: MetadataOps  # the packed metadata's fix-ups on the device (apply_sources, advance_forward)
    commit: Callable  # what each row of a cycle commits, on the device (verify.commit_rows' signature)

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> Backend:
        settings = config.kernels
        if config.uses_triton and config.compile_cache_dir:
            from .kernels import set_cache_dir

            set_cache_dir(config.compile_cache_dir)
        if config.lora_backend == "triton":
            from .kernels.triton_lora import add_lora_group_triton, add_lora_triton

            lora_op = partial(add_lora_triton, settings=settings)
            group_lora_op = partial(add_lora_group_triton, settings=settings)
        else:
            lora_op, group_lora_op = get_lora_op(config.lora_backend), None
        attention = None
        if config.attn_backend == "triton":
            from .kernels.triton_attention import paged_attention_triton

            attention = partial(paged_attention_triton, settings=settings)
        layer_ops: LayerOps = TorchOps()
        metadata, commit = TORCH_METADATA, commit_rows
        if config.layer_ops == "triton":
            from .kernels.triton_fused import TritonOps
            from .kernels.triton_metadata import advance_forward_triton, apply_sources_triton
            from .kernels.triton_verify import commit_rows_triton

            layer_ops = TritonOps(settings, device)
            metadata = MetadataOps(apply_sources_triton, advance_forward_triton)
            commit = commit_rows_triton
        fp8_matmul = None
        if config.quantization == "fp8" and config.layer_ops == "triton":
            from .kernels.triton_fp8 import fp8_linear_triton

            fp8_matmul = partial(fp8_linear_triton, settings=settings)
        weights = weight_format(config.quantization, device, layer_ops.linear, fp8_matmul)
        return cls(layer_ops, lora_op, group_lora_op, attention, weights, metadata, commit)
