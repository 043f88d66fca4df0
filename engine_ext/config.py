"""Engine configuration: dataclasses that validate and derive in __post_init__."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .kernels.settings import KernelSettings
from .quantization import QUANTIZATIONS

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The choices of EngineConfig's kernel fields (backend.py says what each selects)
LORA_BACKENDS = ("torch", "gather", "triton")
ATTN_BACKENDS = ("torch", "triton")
LAYER_OPS = ("torch", "triton")


@dataclass
class SpecConfig:
    """Speculative LoRA-off drafting: the base model drafts, one adapter-on pass verifies."""

    num_draft_tokens: int = 4
    gate: bool = True
    # Gate tuning: the acceptance below which an adapter drafts nothing, and the EMA weight of new
    # observations in the running acceptance rate.
    min_acceptance: float = 0.3
    acceptance_ema: float = 0.1
    initial_acceptance: float = 0.8
    # Passes of a cycle the device may have queued beyond the one it runs while the host plans the next: the host
    # waits for pass j - 1 - draft_lead to end before it takes arrivals in and plans pass j (so requests that arrive
    # during a cycle join it), and hands out the first tokens of the passes that ended. Larger: the host's planning
    # of a pass (about a decode step's host work) hides behind more device work, and an arrival joins later.
    draft_lead: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be in 1..16, got {self.num_draft_tokens}")
        if not 0.0 <= self.min_acceptance <= 1.0 or not 0.0 < self.acceptance_ema <= 1.0:
            raise ValueError("min_acceptance must be in [0, 1] and acceptance_ema in (0, 1]")
        if not 0 <= self.draft_lead <= 16:
            raise ValueError(f"draft_lead must be in 0..16, got {self.draft_lead}")


@dataclass
class EngineConfig:
    # The Hugging Face model directory. None: settings checked before the directory is known (a serving
    # layer's config, resolved where the model is); an engine needs one.
    model: str | None = None
    device: str = "cpu"
    # Tensor parallelism (parallel/): the model sharded over this many ranks, one process each; rank 0 is the
    # engine's own process on `device`, ranks 1.. are worker processes it starts (on a GPU, rank r on the r-th
    # device from `device`'s index: "cuda" or "cuda:0" takes cuda:0 .. cuda:N-1). The model's heads and
    # intermediate size must split over it (checked when the model is read).
    tensor_parallel_size: int = 1
    # How long a collective waits for a rank that is alive but does not answer before it fails the engine (a rank
    # that exits fails it at once). Generous: a first forward may compile kernels on one rank and not another.
    # Starting (the ranks joining, loading their shards) may take up to parallel/comm.JOIN_TIMEOUT_S instead.
    tp_timeout_s: float = 120.0
    dtype: str = "float32"
    # The base model's linear weights (the decoder layers' q/k/v, o, gate/up, down products): None keeps them in
    # `dtype`; "fp8" stores them as float8 e4m3 with per-output-channel scales (quantization.py), quantized as they
    # load or read from a checkpoint stored so. Embeddings, norms, the LM head, LoRA and the KV cache stay in `dtype`.
    # A CPU runs the plain-torch reference (weights widened per product); a CUDA GPU needs compute capability 8.9+.
    quantization: str | None = None
    max_loras: int = 8  # adapter slots on the device
    max_lora_rank: int = 64
    # The adapter slots' width to start at: every slot is read at the slots' width whatever its adapter's rank, so
    # rank-16 adapters in rank-64 slots cost a plain step at batch 32 +63% over rank-16 slots (H100, 1B; RESULTS
    # section 1, "Slot width"). An adapter wider than the slots widens them (to the next power of two, at most
    # max_lora_rank) when it first goes on the device, which recaptures the CUDA graphs then: seconds, once a width.
    # None: max_lora_rank from the start. Tensor-parallel engines always start at max_lora_rank.
    lora_slot_rank: int | None = 16
    max_cpu_loras: int = 64  # adapters kept parsed in host memory (LRU)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    # None: on CPU 0.5 GiB or what max_num_seqs sequences of the longest length use, if less; 85% of free memory
    # on a GPU
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    # The kernels (backend.py), each "torch" (plain-torch references, any device) or "triton" (GPU kernels,
    # launched with `kernels`); the GPU fast path sets all three to "triton".
    lora_backend: str = "torch"  # the batched LoRA op (lora_ops.py); also "gather", the per-token reference
    attn_backend: str = "torch"  # paged attention (attention.py)
    # The decoder layer's element-wise work (norms, rotary + KV write, SiLU): "triton" runs it as fused
    # kernels, which with lora_backend "triton" also take the LoRA math of decode-sized forwards
    # (kernels/triton_fused.py).
    layer_ops: str = "torch"
    # Launch settings of the Triton kernels (block sizes, warps, split-KV); a dict of some fields is accepted.
    kernels: KernelSettings = field(default_factory=KernelSettings)
    # CUDA graphs for decode-shaped forwards of up to `max_graph_tokens` tokens (cuda_graphs.py);
    # needs a CUDA device and attn_backend "triton". Keep max_model_len modest: block tables are static.
    # None: 512, or with speculation enough for the verify pass of a full batch (max_num_seqs x (k + 1)), since
    # a forward past the largest graph runs eager: at the 1B shape on the H200 a 640-token verify pass took
    # 25.5 ms eager against 7.2 ms replayed (bench/RESULTS.md section 1).
    cuda_graphs: bool = False
    max_graph_tokens: int | None = None
    speculative: SpecConfig | None = None
    # Keep the KV of full blocks of committed tokens after their request ends, keyed by (adapter, version, the
    # tokens up to the block's end), and let a new request take the longest chain of its own adapter version
    # instead of computing it (prefix_cache.py). Cached blocks no request holds give way to any allocation.
    enable_prefix_caching: bool = False
    # Start-up: compile every kernel variant and capture every CUDA graph the engine can use before it
    # takes requests (ModelRunner.warm_up), so no request waits for a compile. Only the GPU kernels
    # compile; the plain-torch path has nothing to warm.
    warmup: bool = True
    # Where Triton keeps compiled kernels (None: Triton's own default, ~/.triton/cache). A directory that
    # outlives the process (a volume in a pod) makes the next start-up's compiles cache hits.
    compile_cache_dir: str | None = None
    # Debug mode: every forward's indices (token ids, positions, block tables, adapter slots, logits rows)
    # are checked on the host against the buffers they address before the forward runs; a violation
    # raises ForwardInputError instead of an illegal memory access on the device. Costs host time.
    debug_checks: bool = False
    # AsyncLLMEngine runs the engine core (scheduler, executor, adapters, KV cache; tensor-parallel ranks are its
    # children) in a process of its own and is its client (core/): the caller's Python (streams, rendering,
    # detokenizing) never takes the step loop's interpreter. False: the core runs on a thread of the caller's
    # process (tests, notebooks). LLMEngine itself is the core either way.
    engine_process: bool = False
    torch_dtype: torch.dtype = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        self.torch_dtype = _DTYPES[self.dtype]
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {[None, *QUANTIZATIONS]}")
        if self.model is not None and not os.path.isdir(self.model):
            raise FileNotFoundError(f"model directory not found: {self.model}")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras", "block_size", "max_num_seqs",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lora_slot_rank is not None and not (isinstance(self.lora_slot_rank, int) and self.lora_slot_rank >= 1):
            raise ValueError(f"lora_slot_rank must be an int >= 1 or None, got {self.lora_slot_rank!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras (device slots are filled from the host cache)")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda") and _cuda_index(self.device) < 0:
            raise ValueError(f"device {self.device!r}: tensor parallelism needs 'cuda' or 'cuda:<index>'")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        for name, choices in (("lora_backend", LORA_BACKENDS), ("attn_backend", ATTN_BACKENDS),
                              ("layer_ops", LAYER_OPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {list(choices)}")
        if isinstance(self.kernels, dict):
            self.kernels = KernelSettings.from_dict(self.kernels)
        elif not isinstance(self.kernels, KernelSettings):
            raise ValueError(f"kernels must be a KernelSettings or a dict of its fields, got {self.kernels!r}")
        # The torch attention reference reads meta.max_query_len on the host, which a captured graph would freeze
        if self.cuda_graphs and (not self.device.startswith("cuda") or self.attn_backend != "triton"):
            raise ValueError("cuda_graphs needs a CUDA device and attn_backend='triton'")
        if isinstance(self.speculative, dict):
            self.speculative = SpecConfig(**self.speculative)
        if self.max_graph_tokens is None:
            verify = self.max_num_seqs * (1 + self.speculative.num_draft_tokens) if self.speculative else 0
            self.max_graph_tokens = max(512, min(verify, self.max_num_batched_tokens))
        if self.max_graph_tokens < 1:
            raise ValueError("max_graph_tokens must be >= 1")

    def rank_device(self, rank: int) -> str:
        """The device tensor-parallel rank `rank` runs on: "cpu" for every rank on a CPU."""
        if not self.device.startswith("cuda"):
            return self.device
        return f"cuda:{_cuda_index(self.device) + rank}"

    @property
    def uses_triton(self) -> bool:
        """Whether any kernel choice is a Triton one (those compile, and need Triton installed)."""
        return "triton" in (self.lora_backend, self.attn_backend, self.layer_ops)


def _cuda_index(device: str) -> int:
    """The index of a "cuda" or "cuda:<k>" device (0 for "cuda"); -1 for any other spelling."""
    head, _, index = device.partition(":")
    if head != "cuda":
        return -1
    return int(index) if index.isdigit() else (0 if not index else -1)
