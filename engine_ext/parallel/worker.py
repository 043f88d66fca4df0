"""A worker rank's process: its part of the model, its KV cache and adapter slots, and a loop that applies rank 0's
messages (messages.py) in order, joining each forward's collectives. It holds no scheduler and samples nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ..config import EngineConfig
from ..model_config import load_model_spec
from ..model_runner import ModelRunner
from .adapters import MirrorSlots
from .comm import Collectives
from .layout import ShardLayout
from .messages import Stop

logger = logging.getLogger(__name__)


@dataclass
class WorkerRank:
    runner: ModelRunner
    slots: MirrorSlots
    comm: Collectives


@dataclass(frozen=True)
class WorkerArgs:
    """What rank 0 starts a worker with (picklable: it crosses a spawn)."""

    config: EngineConfig
    rank: int
    port: int
    max_model_len: int
    lookahead: int
    threads: int  # torch's intra-op threads (on a CPU the ranks share the cores rank 0's process may use)


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """The process's entry point: build this rank's shard (in step with rank 0's, through the collectives of the
    runner's construction), then apply messages until Stop, or until rank 0 is gone (its end of the pipe closed)."""
    rank = _build(args)
    try:
        while not isinstance(msg := conn.recv(), Stop):
            msg.apply(rank)
    except EOFError:
        logger.info("tensor-parallel rank %d: rank 0 is gone, exiting", args.rank)


def _build(args: WorkerArgs) -> WorkerRank:
    config = args.config
    device = torch.device(config.rank_device(args.rank))
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = load_model_spec(config.model)
    layout = ShardLayout(spec, args.rank, config.tensor_parallel_size)
    comm = Collectives(args.rank, config.tensor_parallel_size, args.port, device, config.tp_timeout_s)
    runner = ModelRunner(config, spec, device, max_model_len=args.max_model_len, lookahead=args.lookahead,
                         layout=layout, comm=comm)
    slots = MirrorSlots(layout.local, config.max_loras, config.max_lora_rank, config.torch_dtype, device)
    return WorkerRank(runner, slots, comm)
