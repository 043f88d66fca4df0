"""Which part of the model one tensor-parallel rank holds (Megatron layout), as pure functions of the full model.

    q/k/v, gate/up   column-parallel: each rank computes its heads' / its intermediate columns' outputs
    o, down          row-parallel: each rank multiplies its slice of the input; one all-reduce sums the partials
    embed, lm_head   vocab-parallel: rows [rank * V_r, (rank + 1) * V_r), V_r = ceil(V / size), zero-padded

KV heads are split like the query heads; with fewer KV heads than ranks each one is replicated on the
size / num_kv_heads ranks whose query heads read it (rank r holds KV head r // (size / num_kv_heads)).

LoRA follows its layer (S-LoRA): a column-parallel module keeps A whole and its rank's output columns of B; a
row-parallel module keeps its rank's input rows of A and B whole, so its partial delta joins the layer's partial
product before the one all-reduce (no extra collective).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property

import torch

from ..lora_adapter import LoRAWeights
from ..model_config import ModelSpec

# a projection's weight, bias or FP8 scales (quantization.py: one per output row, or one for the whole tensor)
_LAYER_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias|weight_scale)$")
_VOCAB_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """Raise ValueError unless the model splits evenly over `size` ranks."""
    if size == 1:
        return
    problems = []
    if spec.num_heads % size:
        problems.append(f"num_attention_heads {spec.num_heads} is not divisible by it")
    kv = spec.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        problems.append(f"num_key_value_heads {kv} neither divides it nor is divisible by it")
    if spec.intermediate_size % size:
        problems.append(f"intermediate_size {spec.intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not split the model: {'; '.join(problems)}")


@dataclass(frozen=True)
class ShardLayout:
    spec: ModelSpec  # the full model
    rank: int
    size: int

    @cached_property
    def local(self) -> ModelSpec:
        """The model as this rank sees it: its heads, KV heads and intermediate columns (vocab and hidden whole)."""
        s, n = self.spec, self.size
        return dataclasses.replace(s, num_heads=s.num_heads // n, num_kv_heads=max(1, s.num_kv_heads // n),
                                   intermediate_size=s.intermediate_size // n)

    @property
    def vocab_rows(self) -> int:
        """V_r: the embedding and lm_head rows each rank holds (the last rank's padded with zeros)."""
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    # ------------------------------------------------------------ ranges along the sharded dimensions
    def _q(self) -> slice:
        width = self.local.q_size
        return slice(self.rank * width, (self.rank + 1) * width)

    def _kv(self) -> slice:
        s = self.spec
        head = self.rank * s.num_kv_heads // self.size  # the first KV head this rank's query heads read
        return slice(head * s.head_dim, head * s.head_dim + self.local.kv_size)

    def _mlp(self) -> slice:
        width = self.local.intermediate_size
        return slice(self.rank * width, (self.rank + 1) * width)

    def columns(self, module: str) -> slice | None:
        """The output columns of a column-parallel module this rank computes (None: a row-parallel module)."""
        return {"q_proj": self._q, "k_proj": self._kv, "v_proj": self._kv, "gate_proj": self._mlp,
                "up_proj": self._mlp}.get(module, lambda: None)()

    def inputs(self, module: str) -> slice | None:
        """The input rows of a row-parallel module this rank multiplies (None: a column-parallel module)."""
        return {"o_proj": self._q, "down_proj": self._mlp}.get(module, lambda: None)()

    # ------------------------------------------------------------ checkpoint tensors
    def weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (Hugging Face names; [out, in] weights)."""
        if self.size == 1:
            return tensor
        if name in _VOCAB_WEIGHTS:
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
            pad = self.vocab_rows - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows.clone()
        match = _LAYER_WEIGHT.match(name)
        if match is None:
            return tensor  # norms: replicated
        module = match.group(2)
        cols, ins = self.columns(module), self.inputs(module)
        if match.group(3) == "weight_scale":  # per output row: sliced like the rows; a per-tensor scale is whole
            return tensor.reshape(-1)[cols].clone() if cols is not None and tensor.numel() > 1 else tensor
        if cols is not None:
            return tensor[cols].clone()
        if ins is not None and match.group(3) == "weight":
            return tensor[:, ins].clone()
        return tensor

    def lora(self, weights: LoRAWeights) -> LoRAWeights:
        """This rank's part of a parsed adapter: A [in, r] and B [r, out] per (layer, module)."""
        if self.size == 1:
            return weights
        out = LoRAWeights(weights.name, weights.rank, scale=dict(weights.scale))
        for key, a in weights.a.items():
            b, module = weights.b[key], key[1]
            cols, ins = self.columns(module), self.inputs(module)
            out.a[key] = a if cols is not None else a[ins].contiguous()
            out.b[key] = b[:, cols].contiguous() if cols is not None else b
        return out
