"""The Llama-family decoder (Llama, Qwen2, Mistral) as one batched forward over a flat token list.

Every step runs all scheduled tokens of all sequences at once: base matrix products are shared,
each token's adapter is applied by the batched LoRA op, attention reads each sequence's paged cache.
q/k/v and gate/up are fused into single matrix products; their LoRA deltas land on column slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttnMetadata, paged_attention, write_kv
from .constants import LORA_GROUPS
from .lora_ops import LoRAOp
from .model_config import ModelLoadError, ModelSpec
from .rope import apply_rope, cos_sin, inv_frequencies
from .weights import iter_tensors


@dataclass
class LoRABatch:
    """The adapter side of one forward: which slot each token uses and the slot stacks.

    `groups` (optional): per LORA_GROUPS entry the fused stacks (A [L, S, in, nseg*R], B [L, S, R, out_total],
    scale [L, S, nseg], segment start columns) that `group_op` reads in one call per group; without them,
    or without a group op, each module's delta is applied on its column slice of the fused output."""

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
            groups = {g: (slots.group_a[g], slots.group_b[g], slots.group_scale[g], slots.group_segments[g])
                      for g in LORA_GROUPS}
        return cls(op, token_slots, slots.a, slots.b, slots.scale, group_op if groups else None, groups)

    def add(self, layer: int, module: str, y: torch.Tensor, x: torch.Tensor) -> None:
        self.op(y, x, self.a[module][layer], self.b[module][layer], self.scale[module][layer], self.slots)

    # Arguments of the fused kernels (kernels/triton_fused.py) for one layer's groups.
    def shrink_args(self, layer: int, group: str) -> tuple:
        return self.groups[group][0][layer], self.slots

    def expand_args(self, layer: int, group: str, part: torch.Tensor) -> tuple:
        _, b, scale, _ = self.groups[group]
        return part, b[layer], scale[layer], self.slots

    def silu_args(self, layer: int, part: torch.Tensor) -> tuple:
        """gate/up expand and the down shrink."""
        _, b, scale, _ = self.groups["gate_up"]
        return part, b[layer], scale[layer], self.groups["down"][0][layer], self.slots

    def group_args(self, layer: int, group: str) -> tuple:
        """(A, B, scale, slots) of a one-module group (o, down) for a whole delta."""
        a, b, scale, _ = self.groups[group]
        return a[layer], b[layer], scale[layer], self.slots

    def add_group(self, layer: int, group: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """The deltas of every module of `group` on the fused output y (columns in module order)."""
        if self.groups is not None:
            a, b, scale, segments = self.groups[group]
            self.group_op(y, x, a[layer], b[layer], scale[layer], self.slots, segments)
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


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        h, qkv = spec.hidden_size, spec.q_size + 2 * spec.kv_size
        e = dict(dtype=dtype)
        self.input_norm = nn.Parameter(torch.empty(h, **e), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(qkv, h, **e), requires_grad=False)
        self.qkv_bias: nn.Parameter | None = None
        self.o = nn.Parameter(torch.empty(h, spec.q_size, **e), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(h, **e), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * spec.intermediate_size, h, **e), requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, spec.intermediate_size, **e), requires_grad=False)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        e = dict(dtype=dtype)
        self.embed = nn.Parameter(torch.empty(spec.vocab_size, spec.hidden_size, **e), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.empty(spec.hidden_size, **e), requires_grad=False)
        self.lm_head = self.embed if spec.tie_word_embeddings else nn.Parameter(
            torch.empty(spec.vocab_size, spec.hidden_size, **e), requires_grad=False
        )
        self.register_buffer("inv_freq", inv_frequencies(spec.rope, spec.head_dim), persistent=False)
        # cos/sin [positions, head_dim] for every position a forward may see (build_rope_table); without it each
        # forward computes its tokens' rows (seven small kernels a step)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        # The element-wise work between the matrix products (TorchOps; the model runner installs the
        # fused Triton kernels, kernels.triton_fused.TritonOps, with attn_backend "triton").
        self.ops = TorchOps

    # ---------------------------------------------------------------- loading
    def load_weights(self, model_dir: str) -> None:
        spec, pending = self.spec, {}
        for name, tensor in iter_tensors(model_dir):
            pending[name] = tensor
        def take(name: str) -> torch.Tensor:
            try:
                return pending.pop(name)
            except KeyError:
                raise ModelLoadError(f"{model_dir}: weight {name!r} is missing") from None
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
                layer.qkv.copy_(torch.cat([take(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")]))
                if p + "self_attn.q_proj.bias" in pending:
                    bias = torch.cat([take(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")])
                    layer.qkv_bias = nn.Parameter(bias.to(layer.qkv.device, layer.qkv.dtype), requires_grad=False)
                layer.o.copy_(take(p + "self_attn.o_proj.weight"))
                layer.gate_up.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
                layer.down.copy_(take(p + "mlp.down_proj.weight"))
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
        spec, ops = self.spec, self.ops
        qs, eps = spec.q_size, spec.rms_norm_eps
        x = F.embedding(input_ids, self.embed)
        if self.rope_table is not None:  # rows looked up by position inside the rotary op
            (cos, sin), positions = self.rope_table, meta.positions
        else:
            (cos, sin), positions = cos_sin(self.inv_freq, meta.positions, x.dtype), None
        scale = spec.head_dim**-0.5
        delta = None  # the previous sub-block's output, not yet added to the residual stream x
        extra = None  # ... and its LoRA delta (float32), when the fused path computed it beside the product
        # With fused kernels (ops.fuses_lora) and the slots' group stacks, the q/k/v and gate/up shrinks ride
        # in the norm kernels, their expands in the rotary and SiLU kernels, the down shrink in the SiLU
        # kernel; the o delta and the down expand run on a side stream beside the o and down products, and
        # the next norm kernel adds them (its `extra`).
        fuse = (lora is not None and lora.groups is not None and getattr(ops, "fuses_lora", False)
                and input_ids.shape[0] <= ops.max_fused_lora_tokens)
        branch = ops.side_branch(x.device) if fuse else None
        for i, layer in enumerate(self.layers):
            shrink = lora.shrink_args(i, "qkv") if fuse else None
            x, h, part = ops.add_rms_norm(x, delta, layer.input_norm, eps, shrink, extra)
            qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
            if lora is not None and not fuse:
                lora.add_group(i, "qkv", qkv, h)
            k_cache, v_cache = kv_caches[i]
            q = ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, spec.num_heads,
                                  spec.num_kv_heads, lora.expand_args(i, "qkv", part) if fuse else None, positions)
            attn = paged_attention(q, k_cache, v_cache, meta, scale, spec.sliding_windows[i]).reshape(-1, qs)
            if fuse:
                with branch:
                    extra = ops.lora_delta(attn, *lora.group_args(i, "o"))
            o = ops.linear(attn, layer.o)
            if fuse:
                branch.join()
            elif lora is not None:
                lora.add_group(i, "o", o, attn)
            shrink = lora.shrink_args(i, "gate_up") if fuse else None
            x, h, part = ops.add_rms_norm(x, o, layer.post_norm, eps, shrink, extra)
            gate_up = ops.linear(h, layer.gate_up)
            if lora is not None and not fuse:
                lora.add_group(i, "gate_up", gate_up, h)
            act, part = ops.silu_mul(gate_up, lora.silu_args(i, part) if fuse else None)
            if fuse:
                with branch:
                    extra = ops.expand_delta(*lora.expand_args(i, "down", part))
            delta = ops.linear(act, layer.down)
            if fuse:
                branch.join()
            elif lora is not None:
                lora.add_group(i, "down", delta, act)
        # the final norm reads only the rows whose logits are wanted
        _, x, _ = ops.add_rms_norm(x, delta, self.norm, eps, None, extra, rows=logits_indices)
        return ops.linear(x, self.lm_head)


class TorchOps:
    """The decoder layer's element-wise work in plain torch: the reference the fused kernels match.
    (It fuses no LoRA math: the model applies every group's delta with the LoRA op.)"""

    fuses_lora = False

    linear = staticmethod(F.linear)

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
                      positions=None):
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
    def silu_mul(gate_up, lora=None):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up, None
