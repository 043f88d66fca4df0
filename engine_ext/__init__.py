"""The inference engine: Llama-family model, paged KV cache, continuous batching, batched multi-LoRA,
speculative LoRA-off drafting."""

from .async_engine import AsyncLLMEngine
from .config import EngineConfig, SpecConfig
from .errors import EngineDeadError, InvalidParameterError, PromptTooLongError, RequestRefused
from .kernels import KernelSettings
from .llm_engine import LLMEngine, StepContext
from .lora_adapter import AdapterError
from .model_config import ModelLoadError
from .sampling_params import SamplingParams
from .sequence import RequestOutput

__all__ = [
    "AdapterError",
    "AsyncLLMEngine",
    "EngineConfig",
    "EngineDeadError",
    "InvalidParameterError",
    "KernelSettings",
    "LLMEngine",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestRefused",
    "RequestOutput",
    "SamplingParams",
    "SpecConfig",
    "StepContext",
]
