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
    # ---- LoRA folded into the element-wise kernels (triton_fused.py): forwards of one token per sequence up to this
    # many tokens (decode up to one wave of programs; past it the split LoRA kernels after each product measured
    # faster)
    fold_decode_tokens: int = 32
    # Forwards with several tokens of one sequence (verify passes, prompts in graph-sized passes) fold their LoRA math
    # as decode steps do while tokens x slot rank is at most fold_multi_token_ranks and tokens x the layer's LoRA
    # output columns (q, k, v, o, gate, up and down widths on this rank: 23,552 at the Llama-3.2-1B shape, 43,008 at
    # 3.1-8B) at most fold_multi_token_columns: each of a sequence's tokens re-reads its adapter's B tiles (rank x
    # columns), from L2 after the first, so the re-reads grow with all three. Measured at batch 32, rank 16 (bench/
    # RESULTS.md section 1, H100): folding beat LoRA beside the products at 1B up to 96 tokens (2.26M columns), lost
    # at 128 and 160 (3.01M: 2.475 against 2.425 ms; 3.77M); at 8B it beat it at 64 tokens (2.75M: 8.91 against
    # 9.00 ms), lost from 96 (4.13M: 9.71 against 9.28; 160 tokens 11.53 against 10.02). At 1B rank 64 folding beat the
    # split kernels after each product at 64 tokens (3.22 against 4.69 ms, H200) but not at 96 (3.90 against 3.61).
    # 0: every such forward takes another path.
    fold_multi_token_ranks: int = 4096
    fold_multi_token_columns: int = 3_000_000
    # ... and, for slots of rank at most fold_multi_layer_max_rank, only on layers of at most fold_multi_layer_columns
    # LoRA output columns: a wide layer's products are long enough to hide the split kernels beside them at every
    # verify size measured at rank 16 (8B, 43,008 columns, batch 8, k = 1..4: 6.924 / 7.280 / 7.294 / 7.687 ms beside
    # against 7.022 / 7.336 / 7.435 / 8.073 folded; batch 32 from k = 2), where the 1B's (23,552) fold up to 96
    # tokens. Higher ranks fold on any layer: at rank 64 beside the products lost to folding (1B, 64 tokens: 4.87
    # against 3.62 ms), unmeasured at 8B. 0: no bound.
    fold_multi_layer_columns: int = 32768
    fold_multi_layer_max_rank: int = 16
    # ---- LoRA beside the products (model.DecoderLayer.beside_lora): every group's delta computed with the split
    # LoRA kernels on the side stream while the group's base product runs (the rotary, SiLU and norm kernels add the
    # float32 deltas), instead of after each product on the main stream. Forwards with several tokens of a sequence
    # that do not fold take it while tokens x slot rank is at most beside_multi_token_ranks: at rank 16 it beat the
    # kernels after the products (1B, 160 tokens: 2.63 against 2.71 ms; 8B: 10.02 against 10.95), at rank 64 it lost
    # up to 1.6x (1B, 96 tokens: 5.31 against 3.82; its float32 gate/up deltas cross HBM twice, its split kernels
    # take SMs from the products). Decode steps past fold_decode_tokens take it up to beside_lora_tokens tokens: 0,
    # since at batch 32 it cost decode 8% against folding (bench/RESULTS.md section 1). 0: never.
    beside_multi_token_ranks: int = 4096
    beside_lora_tokens: int = 0
    # Multi-token forwards that would go beside the products with at most this many tokens (and tokens x rank within
    # fold_multi_token_ranks) take "mixed" instead: attention's LoRA folded (short products, 5,120 of 1B's 23,552
    # columns), the MLP's beside its products (gate/up's columns are most of a folded token's re-reads); 0: never.
    # Off: at 1B batch 32 k = 4 it took 2.690 ms against beside's 2.665 (H100, bench/RESULTS.md section 1).
    mixed_multi_tokens: int = 0
    # Tokens a run of one adapter is taken to hold in a forward with several tokens of a sequence (a verify pass's
    # k + 1): the split shrink sizes its K splits by the runs (a run's leader does its tokens' work), not the tokens.
    multi_run_tokens: int = 4
    # ---- programmatic dependent launch (pdl.py): the fused kernels and attention launch with it in forwards of up to
    # this many tokens (decode at batch <= 32 is one wave of programs, where overlapping each launch with the kernel
    # before it shortens the forward); 0: never
    pdl_max_tokens: int = 32
    # ---- a slot's rank (AdapterSlots.rank_table): 1 masks every LoRA kernel's A columns and B rows past each slot's
    # adapter rank (zero padding), 0 reads the slots' full width. Off: as written (a mask from a rank read on the
    # device costs the A loads their vector width) the verify pass at batch 32 took 1.4-1.6x, while the plain step
    # at batch 32 gained 7% (H100, rank-16 adapters in rank-64 slots, bench/RESULTS.md section 1)
    rank_masks: int = 0
    # ---- split LoRA shrink / expand (triton_lora.py): the shrink splits K until about shrink_programs run leaders
    # have work (two waves over the H200's 132 SMs; at most K / the K tile splits)
    shrink_programs: int = 264
    shrink_warps: int = 2
    expand_warps: int = 4
    expand_block_n: int = 0  # the expand's column tile; 0: from the rank
    # ---- the dense (bf16) products of the Triton layer ops (TritonOps.linear): from this many tokens up to 256 they
    # take triton_fp8's split-K GEMM over the weights as they are (launched with the fp8_* settings below) instead of
    # cuBLAS; 0: never. cuBLAS's bf16 products at 160 tokens (a verify pass at batch 32, k = 4) run off their bytes on
    # an H100 (1B down 1.8x, 8B o 2.0x their time at 32 tokens), but this GEMM took 1.1-3.1x cuBLAS's time at every
    # product from 32 to 256 tokens, and cuBLASLt, the transposed problem and two half products no better
    # (bench/verify_gemm.py, bench/RESULTS.md section 1): off.
    triton_linear_tokens: int = 0
    # ---- the FP8 weights' W8A16 GEMM (triton_fp8.py), decode-sized products (up to 256 tokens): K columns per inner
    # step, column tile, pipeline stages (K tiles in flight per program) and warps; K is split between programs while
    # the tiles number fewer than fp8_programs and each program keeps at least fp8_split_steps K tiles. Measured on an
    # H100 over the 8B shape's four products at 1-160 tokens (bench/fp8_gemm.py --sweep --variants, bench/RESULTS.md
    # section 15): 64-column tiles and 3 stages took 0.77-0.81x the 128-column, 4-stage tiles' time at 3-32 tokens
    fp8_block_k: int = 128
    fp8_block_n: int = 64
    # the decode-sized tiles' token side at most (a verify pass of 160 tokens in tiles of 64 reads each weight tile
    # three times), and up to how many tokens a product's tile is computed transposed (W8 @ x.T: the widened weights
    # the tensor cores' first operand, the tokens the narrow second; 0: never). Transposed with 128-token tiles, the
    # 8B forward on an H100 took 3-7% longer at batch 1 and 32 and 12-17% less at 64-128 tokens, still 1.1-2.3x
    # bf16's there (bench/RESULTS.md section 15): off
    fp8_block_m: int = 64
    fp8_swap_tokens: int = 0
    fp8_programs: int = 264
    fp8_split_steps: int = 4
    fp8_stages: int = 3
    fp8_warps: int = 4
    # products of at most this many tokens take a GEMV kernel instead (no tensor cores: each weight tile widened to
    # float32 once and multiplied by every token's row, in fp8_gemv_block_n-row tiles, K split as above); 0: never.
    # At one token it took 0.90x the GEMM's 64-column tiles' time, at two 1.13x (8B products, H100)
    fp8_gemv_tokens: int = 1
    fp8_gemv_block_n: int = 64
    # products of more than fp8_multi_tokens tokens, up to the bytes-bound limit (verify passes, short prompts), take
    # their own K and column tiles (0: the decode tiles' fp8_block_k / fp8_block_n; fp8_multi_tokens 0: none do): at
    # 160 tokens the 64-column decode tiles took 1.44x the time of 64-deep, 128-column ones (8B products, H100)
    fp8_multi_tokens: int = 32
    fp8_multi_block_k: int = 64
    fp8_multi_block_n: int = 128

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"KernelSettings.{f.name} must be an int, got {value!r}")
        for name in ("attn_warps", "norm_lora_warps", "rope_lora_warps", "silu_lora_warps", "shrink_warps",
                     "expand_warps", "fp8_warps"):
            _check_pow2(name, getattr(self, name), 1, 32)
        # Tile sides of tl.arange / tl.dot: powers of two, at least 16
        for name in ("attn_block_n", "norm_chunk", "silu_lora_block", "fp8_block_k", "fp8_block_n", "fp8_block_m",
                     "fp8_gemv_block_n"):
            _check_pow2(name, getattr(self, name), 16, 1 << 16)
        for name in ("norm_lora_bk", "silu_lora_sb", "expand_block_n", "attn_rows", "attn_rows_multi",
                     "fp8_multi_block_k", "fp8_multi_block_n"):
            if getattr(self, name):
                _check_pow2(name, getattr(self, name), 16, 1 << 16, zero=True)
        _check_pow2("attn_max_splits", self.attn_max_splits, 1, 256)
        if self.attn_stages < 0:
            raise ValueError(f"KernelSettings.attn_stages must be >= 0, got {self.attn_stages}")
        if self.rank_masks not in (0, 1):
            raise ValueError(f"KernelSettings.rank_masks must be 0 or 1, got {self.rank_masks}")
        # token and size bounds where 0 switches the thing off
        for name in ("pdl_max_tokens", "fold_decode_tokens", "fold_multi_token_ranks", "fold_multi_token_columns",
                     "fold_multi_layer_columns", "fold_multi_layer_max_rank", "beside_lora_tokens",
                     "beside_multi_token_ranks", "mixed_multi_tokens", "triton_linear_tokens", "fp8_swap_tokens",
                     "fp8_multi_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"KernelSettings.{name} must be >= 0, got {getattr(self, name)}")
        if self.multi_run_tokens < 1:
            raise ValueError(f"KernelSettings.multi_run_tokens must be >= 1, got {self.multi_run_tokens}")
        if not 0 <= self.fp8_gemv_tokens <= 16:
            raise ValueError(f"KernelSettings.fp8_gemv_tokens must be in 0..16, got {self.fp8_gemv_tokens}")
        for name in ("fp8_stages", "fp8_programs", "fp8_split_steps", "shrink_programs"):
            if getattr(self, name) < 1:
                raise ValueError(f"KernelSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.attn_split_budget < 1:
            raise ValueError(f"KernelSettings.attn_split_budget must be >= 1, got {self.attn_split_budget}")

    def lora_path(self, num_tokens: int, multi: bool, rank: int, columns: int) -> str:
        """Where the Triton layer ops put a forward's LoRA math (model.LayerOps.lora_path), given its tokens, whether
        some sequence has several of them (`multi`: verify passes, prompts), the slots' rank and the layer's LoRA
        output columns:

        - "fold": into the element-wise kernels: forwards of one token per sequence up to fold_decode_tokens (decode,
          one wave of programs), `multi` forwards while num_tokens x rank is at most fold_multi_token_ranks and
          num_tokens x columns at most fold_multi_token_columns, at ranks up to fold_multi_layer_max_rank only on
          layers of at most fold_multi_layer_columns columns (0: any);
        - "beside": the others while num_tokens x rank is at most beside_multi_token_ranks (`multi`) or num_tokens
          at most beside_lora_tokens (one token a sequence), each group's delta computed beside its product;
          `multi` ones of at most mixed_multi_tokens tokens (and tokens x rank within fold_multi_token_ranks)
          "mixed": attention's folded, the MLP's beside;
        - "after": the rest, the split LoRA kernels after each product."""
        if multi:
            folds_rank = num_tokens * rank <= self.fold_multi_token_ranks
            wide = 0 < self.fold_multi_layer_columns < columns and rank <= self.fold_multi_layer_max_rank
            if folds_rank and not wide and num_tokens * columns <= self.fold_multi_token_columns:
                return "fold"
            if num_tokens * rank > self.beside_multi_token_ranks:
                return "after"
            return "mixed" if folds_rank and num_tokens <= self.mixed_multi_tokens else "beside"
        if num_tokens <= self.fold_decode_tokens:
            return "fold"
        return "beside" if num_tokens <= self.beside_lora_tokens else "after"

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
