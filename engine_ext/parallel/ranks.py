"""How the engine's model is built on its ranks: one runner, or rank 0 of a tensor-parallel group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ..adapter_slots import AdapterSlots, PackedAdapter
from ..config import EngineConfig
from ..lora_adapter import LoRAWeights
from ..model_config import ModelSpec
from ..model_runner import ModelRunner
from .adapters import LeaderSlots, pack_shards
from .layout import ShardLayout, check_tensor_parallel
from .leader import LeaderRunner, RankFailure, WorkerGroup


@dataclass
class Ranks:
    """The engine's model on its ranks: the runner the engine calls, and for more than one rank the adapter slots
    and the packing of an adapter into every rank's part (None: AdapterManager's own, for one rank)."""

    runner: ModelRunner
    slots: AdapterSlots | None = None
    pack: Callable[[LoRAWeights], PackedAdapter] | None = None
    workers: WorkerGroup | None = None

    def alive(self) -> bool:
        """False once a worker rank has exited or failed (the engine cannot run another forward)."""
        if self.workers is None:
            return True
        try:
            self.workers.check()
        except RankFailure:
            return False
        return True

    def close(self) -> None:
        """Stop the worker ranks (nothing for one rank)."""
        if self.workers is not None:
            self.workers.close()


def build_ranks(config: EngineConfig, spec: ModelSpec, device: torch.device, *, max_model_len: int,
                lookahead: int) -> Ranks:
    size = config.tensor_parallel_size
    if size == 1:
        return Ranks(ModelRunner(config, spec, device, max_model_len=max_model_len, lookahead=lookahead))
    check_tensor_parallel(spec, size)
    if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
        raise ValueError(f"tensor_parallel_size {size} from {device} needs more GPUs than the "
                         f"{torch.cuda.device_count()} visible")
    workers = WorkerGroup(config, max_model_len, lookahead)
    try:
        runner = LeaderRunner(config, spec, device, workers, max_model_len=max_model_len, lookahead=lookahead)
    except BaseException:
        workers.close()
        raise
    layouts = [ShardLayout(spec, r, size) for r in range(size)]
    slots = LeaderSlots(layouts[0].local, config.max_loras, config.max_lora_rank, config.torch_dtype, device, workers)
    pack = partial(pack_shards, layouts=layouts, dtype=config.torch_dtype, pin=device.type == "cuda")
    return Ranks(runner, slots, pack, workers)
