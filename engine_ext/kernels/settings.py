"""Launch settings of the Triton kernels, as one validated value (EngineConfig.kernels).

They change how the kernels tile and launch their work, never their results (the GPU tests run the kernels
under other settings against the plain-torch references). The defaults are the best measured on the H200 at
the Llama-3.2-1B shape (measurements in `git show 211e305:bench/RESULTS.md`; bench/forward_ab.py compares settings in the whole forward,
bench/attn_sweep.py and bench/fused_sweep.py kernel by kernel). A 0 where a field allows it means "derived
from the shapes". Importable without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["KernelSettings"]

# The per-token LoRA-folding kernels (triton_fused.py) re-read an adapter's tiles for every token: that pays for
# forwards of one token per sequence up to one wave of programs (decode at batch <= 32).
FUSED_LORA_TOKENS = 32


@dataclass(frozen=True)
class KernelSettings:
    # ---- paged attention (triton_attention.py)
    # Keys per inner step; halved while the K and V tiles of every pipeline stage exceed the shared-memory
    # budget (wide heads, float32 caches).
    attn_block_n: int = 128
    attn_stages: int = 2  # software-pipeline stages of the key loop; 0: Triton's default
    attn_warps: int = 4
    # Tile rows (query tokens x the heads of one KV head group): a run of up to attn_rows // group query
    # tokens of one sequence shares every K/V page it reads. 0: at least 8 query tokens per tile.
    attn_rows: int = 16
    # Split-KV: at small batches one program per (token, KV head) leaves most of the chip idle while it walks
    # the context, so each context is split into up to attn_max_splits shares, as many as keep tokens x KV
    # heads x splits near attn_split_budget programs. It pays at small batches and costs at large ones,
    # hence the small budget.
    attn_max_splits: int = 8
    attn_split_budget: int = 256
    # Tile rows for a sequence with several query tokens in the forward (a verify pass's k+1, a prompt's): its tiles
    # take up to attn_rows_multi // group of them, so a k = 4 verify pass reads every K/V page once, while one-token
    # sequences keep the attn_rows tile (wider tiles cost a decode step their padded rows). At most attn_rows: one
    # tile for both.
    attn_rows_multi: int = 32
    # ---- fused element-wise kernels with LoRA folded in (triton_fused.py)
    norm_chunk: int = 128  # columns of one add_rms_norm program (its share of the row and of the shrink)
    norm_lora_bk: int = 0  # columns per inner step of add_rms_norm's shrink (its A tile); 0: from the rank
    norm_lora_warps: int = 2
    rope_lora_warps: int = 1
    # Columns of one silu_mul program with LoRA: more, smaller programs than without (each also reads its B
    # and A_down tiles).
    silu_lora_block: int = 512
    silu_lora_sb: int = 0  # columns per inner step of silu_mul with LoRA; 0: from the rank
    silu_lora_warps: int = 2
    # ---- the LoRA-folding kernels over row groups (triton_grouped.py): forwards with a sequence of several tokens
    # (verify passes, prompts in graph-sized passes) or more tokens than the per-token folding takes fold their LoRA
    # math a group of up to group_rows tokens on one adapter at a time (each adapter tile read once per group).
    # 0: such forwards apply LoRA with the split kernels after each product instead.
    group_rows: int = 16
    group_norm: int = 1  # 0: grouped forwards' norms (and their shrinks) take the per-token kernel, rope/SiLU grouped
    group_norm_chunk: int = 256  # columns of one grouped add_rms_norm program (its share of the shrink)
    group_sb: int = 0  # columns per inner step of the grouped silu_mul; 0: from the rank
    group_warps: int = 4
    # Forwards with several tokens of one sequence of up to this many tokens fold LoRA token by token instead (the
    # per-token kernels re-read an adapter's tiles for each of a sequence's tokens, from L2 after the first)
    token_fold_multi_tokens: int = 0
    # ---- split LoRA shrink / expand (triton_lora.py)
    shrink_warps: int = 2
    expand_warps: int = 4
    expand_block_n: int = 0  # the expand's column tile; 0: from the rank

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"KernelSettings.{f.name} must be an int, got {value!r}")
        for name in ("attn_warps", "norm_lora_warps", "rope_lora_warps", "silu_lora_warps", "shrink_warps",
                     "expand_warps", "group_warps"):
            _check_pow2(name, getattr(self, name), 1, 32)
        # Tile sides of tl.arange / tl.dot: powers of two, at least 16
        for name in ("attn_block_n", "norm_chunk", "silu_lora_block", "group_norm_chunk"):
            _check_pow2(name, getattr(self, name), 16, 1 << 16)
        if self.group_rows:  # a tensor-core tile of rows
            _check_pow2("group_rows", self.group_rows, 16, 64, zero=True)
        for name in ("norm_lora_bk", "silu_lora_sb", "expand_block_n", "attn_rows", "attn_rows_multi", "group_sb"):
            if getattr(self, name):
                _check_pow2(name, getattr(self, name), 16, 1 << 16, zero=True)
        _check_pow2("attn_max_splits", self.attn_max_splits, 1, 256)
        if self.attn_stages < 0:
            raise ValueError(f"KernelSettings.attn_stages must be >= 0, got {self.attn_stages}")
        if self.attn_split_budget < 1:
            raise ValueError(f"KernelSettings.attn_split_budget must be >= 1, got {self.attn_split_budget}")

    def lora_fold(self, num_tokens: int, multi: bool, max_group_tokens: int) -> int:
        """How the Triton layer ops apply a forward's LoRA math (model.LayerOps.lora_fold): 1 folded token by token
        (decode sizes: one token per sequence, up to FUSED_LORA_TOKENS); group_rows folded a group of tokens on one
        adapter at a time (several tokens of one sequence, as in a verify pass, or more tokens, up to
        `max_group_tokens`: the CUDA graphs' sizes); 0 the split LoRA kernels after each product (longer eager
        forwards: prompts past the graphs, where the grouped kernels' grids would be mostly idle programs)."""
        if num_tokens <= (self.token_fold_multi_tokens if multi else FUSED_LORA_TOKENS):
            return 1
        return self.group_rows if num_tokens <= max_group_tokens else 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KernelSettings:
        """From a (JSON) dict of some fields; the rest keep their defaults. Unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown kernel settings {unknown}; known: {sorted(known)}")
        return cls(**values)


def _check_pow2(name: str, value: int, low: int, high: int, zero: bool = False) -> None:
    if not low <= value <= high or value & (value - 1):
        allowed = f"0 or a power of two in {low}..{high}" if zero else f"a power of two in {low}..{high}"
        raise ValueError(f"KernelSettings.{name} must be {allowed}, got {value}")
