"""Tensor parallelism: one engine's model sharded over `EngineConfig.tensor_parallel_size` ranks, one process
each (layout.py: which part each rank holds; comm.py: the collectives; leader.py: rank 0, the engine's process;
worker.py: the others; adapters.py: adapter slots in lock-step)."""
