"""The engine core and its client's side of it: the step loop (EngineCore) on a thread of the client's process
(ThreadCore) or in a process of its own (ProcessCore, process.py), the messages between them, and each request's
stream on the client. AsyncLLMEngine (async_engine.py) is the client."""

from .process_core import CORE_MODULE, CoreLaunch

__all__ = ["CORE_MODULE", "CoreLaunch"]
