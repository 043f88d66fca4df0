"""The Llama-family decoder (Llama, Qwen2, Mistral) as one batched forward over a flat token list.

Every step runs all scheduled tokens of all sequences at once: base matrix products are shared,
each token's adapter is applied by the batched LoRA op, attention reads each sequence's paged cache.
q/k/v and gate/up are fused into single matrix products; their LoRA deltas land on column slices.

The element-wise work between the products is the `LayerOps` the model is built with: TorchOps below, or
the fused Triton kernels (kernels/triton_fused.TritonOps), which can also take the LoRA math of
decode-sized forwards (DecoderLayer.fused_lora). The products' weights are held and multiplied in the model's
`WeightFormat` (quantization.py): dense in the model's dtype, or FP8 with per-output-channel scales.

Tensor parallelism (parallel/layout.py): a model built with a rank's ShardLayout holds that rank's heads,
intermediate columns and vocab rows; its collectives (parallel/comm.py) sum the o and down products (with their
LoRA partials) and the embedding over the ranks, and join the logits' vocab columns. One rank's collectives do
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttnMetadata, paged_attention, write_kv
from .constants import LORA_GROUPS
from .lora_ops import LoRAOp
from .model_config import ModelLoadError, ModelSpec
from .parallel.comm import ONE_RANK, Collectives, SingleRank
from .parallel.layout import ShardLayout
from .quantization import DenseWeights, WeightFormat
from .rope import apply_rope, cos_sin, inv_frequencies
from .weights import iter_tensors


@dataclass
class LoRABatch:
    """The adapter side of one forward: which slot each token uses and the slot stacks.

    `groups` (optional): per LORA_GROUPS entry the fused stacks (A [L, S, in, nseg*R], B [L, S, R, out_total],
    scale [L, S, nseg], segment start columns, each slot's rank in the group [S] int32: past it A and B are zero
    padding) that `group_op` and the fused kernels read; without them, or without a group op, each module's delta is
    applied on its column slice of the fused output."""

    op: LoRAOp
    slots: torch.Tensor  # [T] long, the zero slot for base-only tokens
    a: dict[str, torch.Tensor]  # module -> [L, S, in, R]
    b: dict[str, torch.Tensor]  # module -> [L, S, R, out]
    scale: dict[str, torch.Tensor]  # module -> [L, S]
    group_op: Callable | None = None
    groups: dict[str, tuple] | None = None

    @classmethod
    def from_slots(cls, op: LoRAOp, token_slots: torch.Tensor, slots, group_op: Callable | None = None) -> LoRABatch:
        """From an AdapterSlots (its fused group stacks are used when it has them and a group op is given)."""
        groups = None
        if group_op is not None and getattr(slots, "group_a", None) is not None:
            groups = {g: (slots.group_a[g], slots.group_b[g], slots.group_scale[g], slots.group_segments[g],
                          slots.group_rank[g]) for g in LORA_GROUPS}
        return cls(op, token_slots, slots.a, slots.b, slots.scale, group_op if groups else None, groups)

    @property
    def rank(self) -> int:
        """The slots' rank (every adapter's is padded to it)."""
        return next(iter(self.a.values())).shape[-1]

    def add(self, layer: int, module: str, y: torch.Tensor, x: torch.Tensor) -> None:
        self.op(y, x, self.a[module][layer], self.b[module][layer], self.scale[module][layer], self.slots)

    # Arguments of the fused kernels (kernels/triton_fused.py) for one layer's groups.
    def shrink_args(self, layer: int, group: str) -> tuple:
        """(A, slots, ranks, R) of the shrink a norm kernel folds."""
        a, _, _, _, ranks = self.groups[group]
        return a[layer], self.slots, ranks, self.rank

    def expand_args(self, layer: int, group: str, part: torch.Tensor) -> tuple:
        _, b, scale, _, ranks = self.groups[group]
        return part, b[layer], scale[layer], self.slots, ranks

    def silu_args(self, layer: int, part: torch.Tensor) -> tuple:
        """gate/up expand and the down shrink."""
        _, b, scale, _, ranks = self.groups["gate_up"]
        down_a, down_ranks = self.groups["down"][0], self.groups["down"][4]
        return part, b[layer], scale[layer], down_a[layer], self.slots, ranks, down_ranks

    def group_args(self, layer: int, group: str) -> tuple:
        """(A, B, scale, slots, ranks) of a one-module group (o, down) for a whole delta."""
        a, b, scale, _, ranks = self.groups[group]
        return a[layer], b[layer], scale[layer], self.slots, ranks

    def fused_group_args(self, layer: int, group: str) -> tuple:
        """(A, B, scale, slots, segments, ranks) of a fused group (q/k/v, gate/up) for its deltas."""
        a, b, scale, segments, ranks = self.groups[group]
        return a[layer], b[layer], scale[layer], self.slots, segments, ranks

    def add_group(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """The deltas of every module of `group` on the fused output y (columns in module order)."""
        if self.groups is not None:
            a, b, scale, segments, ranks = self.groups[group]
            self.group_op(y, x, a[layer], b[layer], scale[layer], self.slots, segments, ranks)
            return
        start = 0
        for module in LORA_GROUPS[group]:
            width = self.b[module].shape[-1]
            self.add(layer, module, y[:, start : start + width], x)
            start += width


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LayerOps(Protocol):
    """The decoder layer's element-wise work between its matrix products (TorchOps is the reference).

    add_rms_norm(x, delta, weight, eps, lora, extra, rows) -> (x + delta, rms_norm(x + delta) * weight, part)
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, lora, positions, extra) -> q
    silu_mul(gate_up, lora, extra) -> (silu(gate) * up, part)

    `extra` is a float32 delta added first (to delta in add_rms_norm). Ops that take LoRA math (`fuses_lora`) say
    where, per forward (`lora_path(num_tokens, multi, rank, columns)`; `multi`: some sequence has several tokens in
    it, as in a verify pass; `rank`: the slots'; `columns`: a layer's LoRA output columns): "fold" (the `lora`
    arguments of the element-wise kernels, DecoderLayer.fused_lora), "beside" (float32 deltas computed beside each
    product, DecoderLayer.beside_lora), "mixed" (attention's folded, the MLP's beside, DecoderLayer.mixed_lora) or
    "after" (the LoRA op after each product, DecoderLayer.plain); they also provide lora_delta, group_delta,
    expand_delta and side_branch (kernels/triton_fused.TritonOps). The others are only ever passed None as `lora`
    and `extra` of the rotary and SiLU ops."""

    fuses_lora: bool

    def lora_path(self, num_tokens: int, multi: bool, rank: int, columns: int) -> str: ...
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def add_rms_norm(self, x, delta, weight, eps, lora=None, extra=None, rows=None) -> tuple: ...
    def rope_write_kv(self, qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, lora=None,
                      positions=None, extra=None) -> torch.Tensor: ...
    def silu_mul(self, gate_up, lora=None, extra=None) -> tuple: ...


@dataclass
class LayerInputs:
    """What every layer of one forward reads besides its own weights and KV cache."""

    meta: AttnMetadata
    cos: torch.Tensor  # [T, head_dim], or with `positions` [P, head_dim] tables over positions
    sin: torch.Tensor
    positions: torch.Tensor | None  # [T]: rows of the cos/sin tables (CausalLM.build_rope_table)
    lora: LoRABatch | None


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, index: int,
                 comm: Collectives | SingleRank = ONE_RANK, weights: WeightFormat | None = None):
        """spec: the model as this rank holds it (ShardLayout.local); comm: the ranks' collectives; weights: how the
        four products' weights are held and multiplied (quantization.py; None: dense in `dtype`)."""
        super().__init__()
        self.spec, self.index, self.comm = spec, index, comm
        weights = weights or DenseWeights()
        self.linear = weights.linear  # every product of the layer: x @ W.T (+ bias), in the weights' format
        h, qkv = spec.hidden_size, spec.q_size + 2 * spec.kv_size
        e = dict(dtype=dtype)
        self.input_norm = nn.Parameter(torch.empty(h, **e), requires_grad=False)
        self.qkv = weights.empty(qkv, h, dtype)
        self.qkv_bias: nn.Parameter | None = None
        self.o = weights.empty(h, spec.q_size, dtype)
        self.post_norm = nn.Parameter(torch.empty(h, **e), requires_grad=False)
        self.gate_up = weights.empty(2 * spec.intermediate_size, h, dtype)
        self.down = weights.empty(h, spec.intermediate_size, dtype)

    def _attention(self, ops: LayerOps, qkv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                   inp: LayerInputs, lora_args: tuple | None = None, extra: torch.Tensor | None = None,
                   ) -> torch.Tensor:
        """Rotary + KV write, then paged attention -> [T, q_size]."""
        spec, (k_cache, v_cache) = self.spec, kv_cache
        q = ops.rope_write_kv(qkv, inp.cos, inp.sin, k_cache, v_cache, inp.meta.slot_mapping, spec.num_heads,
                              spec.num_kv_heads, lora_args, inp.positions, extra)
        out = paged_attention(q, k_cache, v_cache, inp.meta, spec.head_dim**-0.5, spec.sliding_windows[self.index])
        return out.reshape(-1, spec.q_size)

    def plain(self, ops: LayerOps, x: torch.Tensor, delta: torch.Tensor | None,
              kv_cache: tuple[torch.Tensor, torch.Tensor], inp: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, each product's LoRA deltas (if any) added by the LoRA op after it. `delta` is the previous
        layer's output, not yet in the residual stream x; returns (x, this layer's output)."""
        i, lora, eps = self.index, inp.lora, self.spec.rms_norm_eps
        x, h, _ = ops.add_rms_norm(x, delta, self.input_norm, eps)
        qkv = self.linear(h, self.qkv, self.qkv_bias)
        if lora is not None:
            lora.add_group(i, "qkv", qkv, h)
        attn = self._attention(ops, qkv, kv_cache, inp)
        o = self.linear(attn, self.o)
        if lora is not None:
            lora.add_group(i, "o", o, attn)
        o = self.comm.all_reduce(o)  # row-parallel: the ranks' partial products (and LoRA partials) summed
        x, h, _ = ops.add_rms_norm(x, o, self.post_norm, eps)
        gate_up = self.linear(h, self.gate_up)
        if lora is not None:
            lora.add_group(i, "gate_up", gate_up, h)
        act, _ = ops.silu_mul(gate_up)
        down = self.linear(act, self.down)
        if lora is not None:
            lora.add_group(i, "down", down, act)
        return x, self.comm.all_reduce(down)

    def fused_lora(self, ops: LayerOps, x: torch.Tensor, delta: torch.Tensor | None, extra: torch.Tensor | None,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], inp: LayerInputs,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer with the LoRA math in ops that fold it (TritonOps): the q/k/v and gate/up shrinks ride in
        the norm kernels, their expands in the rotary and SiLU kernels, the down shrink in the SiLU kernel.
        The o delta and the down expand run on the side stream beside the o and down products, into float32
        buffers (`extra`) that the next norm kernel adds with the product. Returns (x, output, its extra)."""
        return self._mlp_folded(ops, *self._attention_folded(ops, x, delta, extra, kv_cache, inp), inp)

    def beside_lora(self, ops: LayerOps, x: torch.Tensor, delta: torch.Tensor | None, extra: torch.Tensor | None,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], inp: LayerInputs,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer with every group's LoRA delta computed on the side stream while the group's base product runs
        (the split kernels, float32 buffers): the rotary kernel adds q/k/v's, the SiLU kernel gate/up's, the next
        norm kernels o's and down's. Returns (x, output, its extra), as fused_lora."""
        return self._mlp_beside(ops, *self._attention_beside(ops, x, delta, extra, kv_cache, inp), inp)

    def mixed_lora(self, ops: LayerOps, x: torch.Tensor, delta: torch.Tensor | None, extra: torch.Tensor | None,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], inp: LayerInputs,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention's LoRA folded as in fused_lora (its products are short, its columns few), the MLP's beside its
        products as in beside_lora (gate/up's columns are most of a folded token's re-reads). Returns (x, output,
        its extra), as fused_lora."""
        return self._mlp_beside(ops, *self._attention_folded(ops, x, delta, extra, kv_cache, inp), inp)

    def _attention_folded(self, ops, x, delta, extra, kv_cache, inp):
        """The attention half of fused_lora -> (x, o, o's extra)."""
        i, lora, eps = self.index, inp.lora, self.spec.rms_norm_eps
        x, h, part = ops.add_rms_norm(x, delta, self.input_norm, eps, lora.shrink_args(i, "qkv"), extra)
        qkv = self.linear(h, self.qkv, self.qkv_bias)
        attn = self._attention(ops, qkv, kv_cache, inp, lora.expand_args(i, "qkv", part))
        return x, *self._o_beside(ops, attn, inp)

    def _attention_beside(self, ops, x, delta, extra, kv_cache, inp):
        """The attention half of beside_lora -> (x, o, o's extra)."""
        i, lora, eps, branch, multi = self.index, inp.lora, self.spec.rms_norm_eps, ops.side_branch, inp.meta.multi
        x, h, _ = ops.add_rms_norm(x, delta, self.input_norm, eps, None, extra)
        with branch:
            d_qkv = ops.group_delta(h, *lora.fused_group_args(i, "qkv"), multi=multi)
        qkv = self.linear(h, self.qkv, self.qkv_bias)
        branch.join()
        attn = self._attention(ops, qkv, kv_cache, inp, extra=d_qkv)
        return x, *self._o_beside(ops, attn, inp)

    def _o_beside(self, ops, attn, inp):
        """The o product with its LoRA delta computed beside it on the side stream (both attention halves) -> (o,
        its float32 extra), summed over the ranks."""
        with ops.side_branch:
            extra = ops.lora_delta(attn, *inp.lora.group_args(self.index, "o"), multi=inp.meta.multi)
        o = self.linear(attn, self.o)
        ops.side_branch.join()
        return self._reduce(o, extra)

    def _mlp_folded(self, ops, x, o, extra, inp):
        """The MLP half of fused_lora -> (x, down, down's extra)."""
        i, lora, eps, branch = self.index, inp.lora, self.spec.rms_norm_eps, ops.side_branch
        x, h, part = ops.add_rms_norm(x, o, self.post_norm, eps, lora.shrink_args(i, "gate_up"), extra)
        gate_up = self.linear(h, self.gate_up)
        act, part = ops.silu_mul(gate_up, lora.silu_args(i, part))
        with branch:
            extra = ops.expand_delta(*lora.expand_args(i, "down", part))
        down = self.linear(act, self.down)
        branch.join()
        return x, *self._reduce(down, extra)

    def _mlp_beside(self, ops, x, o, extra, inp):
        """The MLP half of beside_lora -> (x, down, down's extra)."""
        i, lora, eps, branch, multi = self.index, inp.lora, self.spec.rms_norm_eps, ops.side_branch, inp.meta.multi
        x, h, _ = ops.add_rms_norm(x, o, self.post_norm, eps, None, extra)
        with branch:
            d_gate_up = ops.group_delta(h, *lora.fused_group_args(i, "gate_up"), multi=multi)
        gate_up = self.linear(h, self.gate_up)
        branch.join()
        act, _ = ops.silu_mul(gate_up, None, d_gate_up)
        with branch:
            extra = ops.lora_delta(act, *lora.group_args(i, "down"), multi=multi)
        down = self.linear(act, self.down)
        branch.join()
        return x, *self._reduce(down, extra)

    def _reduce(self, y: torch.Tensor, extra: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A row-parallel product and its float32 LoRA delta summed over the ranks: one all-reduce of their sum
        (one rank: both unchanged, for the next norm kernel to add)."""
        if self.comm.size == 1:
            return y, extra
        if extra is not None:
            y = (y.float() + extra).to(y.dtype)
        return self.comm.all_reduce(y), None


# A forward's LoRA path (CausalLM.lora_path) -> the layer method that runs it; "after" is DecoderLayer.plain
_LAYER_LORA = {"fold": DecoderLayer.fused_lora, "beside": DecoderLayer.beside_lora, "mixed": DecoderLayer.mixed_lora}


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, ops: LayerOps, layout: ShardLayout | None = None,
                 comm: Collectives | SingleRank = ONE_RANK, weights: WeightFormat | None = None):
        """spec: the full model; layout: the part of it this rank holds (None: all of it); comm: the ranks'
        collectives (ONE_RANK for one); weights: the decoder layers' product weights (None: dense, ops.linear)."""
        super().__init__()
        self.layout = layout or ShardLayout(spec, 0, 1)
        self.spec, self.comm = spec, comm
        local = self.layout.local
        self.ops = ops  # the element-wise work between the matrix products
        # a layer's LoRA output columns on this rank (q, k, v, o, gate, up, down), which a folded token re-reads
        self.lora_columns = sum(out for _, out in local.module_shapes().values())
        self.weights = weights or DenseWeights(ops.linear)
        e = dict(dtype=dtype)
        vocab = self.layout.vocab_rows
        self.embed = nn.Parameter(torch.empty(vocab, spec.hidden_size, **e), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(local, dtype, i, comm, self.weights)
                                    for i in range(spec.num_layers))
        self.norm = nn.Parameter(torch.empty(spec.hidden_size, **e), requires_grad=False)
        self.lm_head = self.embed if spec.tie_word_embeddings else nn.Parameter(
            torch.empty(vocab, spec.hidden_size, **e), requires_grad=False
        )
        self.register_buffer("inv_freq", inv_frequencies(spec.rope, spec.head_dim), persistent=False)
        # cos/sin [positions, head_dim] for every position a forward may see (build_rope_table); without it each
        # forward computes its tokens' rows (seven small kernels a step)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------- loading
    def load_weights(self, model_dir: str) -> None:
        spec, pending, fmt = self.spec, {}, self.weights
        for name, tensor in iter_tensors(model_dir):
            for key, value in fmt.prepare(name, tensor):  # FP8: a dense projection weight quantized, whole rows
                pending[key] = self.layout.weight(key, value)  # this rank's part (all of it for one rank)
        def take(name: str) -> torch.Tensor:
            try:
                return pending.pop(name)
            except KeyError:
                raise ModelLoadError(f"{model_dir}: weight {name!r} is missing") from None
        def product(weight, prefix: str, modules: tuple[str, ...]) -> None:
            fmt.copy_(weight, [fmt.part(take, prefix + m) for m in modules])  # fused in output order
        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if not spec.tie_word_embeddings:
                self.lm_head.copy_(take("lm_head.weight"))
            pending.pop("lm_head.weight", None)  # tied checkpoints may still store a copy
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.input_norm.copy_(take(p + "input_layernorm.weight"))
                layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
                product(layer.qkv, p + "self_attn.", ("q_proj", "k_proj", "v_proj"))
                if p + "self_attn.q_proj.bias" in pending:
                    bias = torch.cat([take(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")])
                    layer.qkv_bias = nn.Parameter(bias.to(layer.input_norm.device, layer.input_norm.dtype),
                                                  requires_grad=False)
                product(layer.o, p + "self_attn.", ("o_proj",))
                product(layer.gate_up, p + "mlp.", ("gate_proj", "up_proj"))
                product(layer.down, p + "mlp.", ("down_proj",))
        leftovers = [n for n in pending if not n.endswith("rotary_emb.inv_freq")]
        if leftovers:
            raise ModelLoadError(f"{model_dir}: weights the engine does not know how to use: {leftovers[:5]}")

    def build_rope_table(self, num_positions: int) -> None:
        """Precompute cos/sin for positions [0, num_positions): the rotary kernel then reads each token's rows by
        its position. Element-wise the same computation as per-step cos_sin, so the same bits."""
        positions = torch.arange(num_positions, device=self.inv_freq.device)
        self.rope_table = cos_sin(self.inv_freq, positions, self.embed.dtype)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttnMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,  # [N] rows of the flat token list whose next-token logits are wanted
        lora: LoRABatch | None,
    ) -> torch.Tensor:  # [N, vocab] in the model's dtype (callers upcast where they need float32)
        ops = self.ops
        x = self._embed(input_ids)
        if self.rope_table is not None:  # rows looked up by position inside the rotary op
            (cos, sin), positions = self.rope_table, meta.positions
        else:
            (cos, sin), positions = cos_sin(self.inv_freq, meta.positions, x.dtype), None
        inp = LayerInputs(meta, cos, sin, positions, lora)
        delta = extra = None  # the last layer's output, not yet added to the residual stream x, and its LoRA delta
        path = self.lora_path(lora, input_ids.shape[0], meta.multi)
        if path != "after":
            layer_lora = _LAYER_LORA[path]
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, delta, extra = layer_lora(layer, ops, x, delta, extra, kv_cache, inp)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x, delta = layer.plain(ops, x, delta, kv_cache, inp)
        # the final norm reads only the rows whose logits are wanted
        _, x, _ = ops.add_rms_norm(x, delta, self.norm, self.spec.rms_norm_eps, None, extra, rows=logits_indices)
        logits = ops.linear(x, self.lm_head)
        if self.comm.size == 1:
            return logits
        return self.comm.gather_columns(logits)[:, : self.spec.vocab_size]  # every rank's vocab rows, unpadded

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]. Vocab-parallel: each rank looks up the ids in its rows (zeros for the others'), and
        the sum over the ranks is every token's row (exact: one term is the row, the rest are zero)."""
        if self.comm.size == 1:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.layout.vocab_start
        mine = (local >= 0) & (local < self.layout.vocab_rows)
        x = F.embedding(local.clamp(0, self.layout.vocab_rows - 1), self.embed) * mine[:, None].to(self.embed.dtype)
        return self.comm.all_reduce(x)

    def lora_path(self, lora: LoRABatch | None, num_tokens: int, multi: bool) -> str:
        """Where a forward's LoRA math goes: "fold" (into the element-wise kernels, DecoderLayer.fused_lora), "beside"
        (deltas computed beside each product, DecoderLayer.beside_lora), as ops that take it name it for the
        forward (LayerOps.lora_path; `multi`: some sequence has several tokens in it) given the slots' fused group
        stacks; otherwise "after" (the LoRA op after each product, DecoderLayer.plain; also without adapters)."""
        if not (self.ops.fuses_lora and lora is not None and lora.groups is not None):
            return "after"
        return self.ops.lora_path(num_tokens, multi, lora.rank, self.lora_columns)


class TorchOps:
    """The decoder layer's element-wise work in plain torch (LayerOps): the reference the fused kernels match.
    It folds no LoRA math: the model applies every group's delta with the LoRA op."""

    fuses_lora = False

    linear = staticmethod(F.linear)

    @staticmethod
    def lora_path(num_tokens: int, multi: bool, rank: int, columns: int) -> str:
        return "after"

    @staticmethod
    def add_rms_norm(x, delta, weight, eps, lora=None, extra=None, rows=None):
        if rows is not None:
            x, delta = x[rows], None if delta is None else delta[rows]
            extra = None if extra is None else extra[rows]
        if extra is not None:  # float32, beside delta (see kernels/triton_fused.add_rms_norm)
            delta = (delta.float() + extra).to(delta.dtype)
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps), None

    @staticmethod
    def rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, lora=None,
                      positions=None, extra=None):
        if extra is not None:  # float32 deltas of the q/k/v columns
            qkv = (qkv.float() + extra).to(qkv.dtype)
        if positions is not None:  # cos/sin are tables over positions
            cos, sin = cos[positions], sin[positions]
        d = k_cache.shape[-1]
        qs, kvs = num_heads * d, num_kv_heads * d
        q = apply_rope(qkv[:, :qs].view(-1, num_heads, d), cos, sin)
        k = apply_rope(qkv[:, qs : qs + kvs].view(-1, num_kv_heads, d), cos, sin)
        v = qkv[:, qs + kvs :].reshape(-1, num_kv_heads, d)
        write_kv(k_cache, v_cache, k, v, slot_mapping)
        return q

    @staticmethod
    def silu_mul(gate_up, lora=None, extra=None):
        if extra is not None:  # float32 deltas of the gate/up columns
            gate_up = (gate_up.float() + extra).to(gate_up.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up, None
