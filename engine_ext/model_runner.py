"""Owns the model weights and the paged KV cache; runs one batched forward."""

from __future__ import annotations

import logging

import torch

from .adapter_slots import AdapterSlots
from .batch import ForwardBatch, SeqWork, build_forward_batch
from .config import EngineConfig
from .lora_ops import get_lora_op
from .model import CausalLM, LoRABatch
from .model_config import ModelSpec

logger = logging.getLogger(__name__)


def _kv_blocks(config: EngineConfig, spec: ModelSpec, device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = 2 * spec.num_layers * config.block_size * spec.kv_size * torch.finfo(config.torch_dtype).bits // 8
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = 0.85 * free
    else:
        budget = 0.5 * 2**30
    return max(1, int(budget // per_block))


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device):
        self.config, self.spec, self.device = config, spec, device
        with torch.device(device):
            self.model = CausalLM(spec, config.torch_dtype)
        self.model.load_weights(config.model)
        self.model.eval()
        self.num_blocks = _kv_blocks(config, spec, device)
        shape = (self.num_blocks, config.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=config.torch_dtype, device=device),
             torch.zeros(shape, dtype=config.torch_dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        self.lora_op = get_lora_op(config.lora_backend)
        logger.info("model %s loaded on %s: %d KV blocks of %d tokens", spec.architecture, device,
                    self.num_blocks, config.block_size)

    @torch.inference_mode()
    def run(self, work: list[SeqWork], slots: AdapterSlots, use_lora: bool = True) -> torch.Tensor:
        """Returns next-token logits [sum(num_logits), vocab] float32. `use_lora=False`: the base model."""
        batch: ForwardBatch = build_forward_batch(work, self.config.block_size, slots.zero_slot, self.device)
        lora = None
        if use_lora and batch.has_lora:
            lora = LoRABatch(self.lora_op, batch.lora_slots, slots.a, slots.b, slots.scale)
        return self.model(batch.input_ids, batch.attn, self.kv_caches, batch.logits_indices, lora)
