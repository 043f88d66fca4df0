"""The Llama-family decoder (Llama, Qwen2, Mistral) as one batched forward over a flat token list.

Every step runs all scheduled tokens of all sequences at once: base matrix products are shared,
each token's adapter is applied by the batched LoRA op, attention reads each sequence's paged cache.
q/k/v and gate/up are fused into single matrix products; their LoRA deltas land on column slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttnMetadata, paged_attention, write_kv
from .lora_ops import LoRAOp
from .model_config import ModelLoadError, ModelSpec
from .rope import apply_rope, cos_sin, inv_frequencies
from .weights import iter_tensors


@dataclass
class LoRABatch:
    """The adapter side of one forward: which slot each token uses and the slot stacks."""

    op: LoRAOp
    slots: torch.Tensor  # [T] long, the zero slot for base-only tokens
    a: dict[str, torch.Tensor]  # module -> [L, S, in, R]
    b: dict[str, torch.Tensor]  # module -> [L, S, R, out]
    scale: dict[str, torch.Tensor]  # module -> [L, S]

    def add(self, layer: int, module: str, y: torch.Tensor, x: torch.Tensor) -> None:
        self.op(y, x, self.a[module][layer], self.b[module][layer], self.scale[module][layer], self.slots)


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

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttnMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,  # [N] rows of the flat token list whose next-token logits are wanted
        lora: LoRABatch | None,
    ) -> torch.Tensor:  # [N, vocab] float32
        spec = self.spec
        qs, kvs = spec.q_size, spec.kv_size
        x = F.embedding(input_ids, self.embed)
        cos, sin = cos_sin(self.inv_freq, meta.positions, x.dtype)
        scale = spec.head_dim**-0.5
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, spec.rms_norm_eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            if lora is not None:
                lora.add(i, "q_proj", qkv[:, :qs], h)
                lora.add(i, "k_proj", qkv[:, qs : qs + kvs], h)
                lora.add(i, "v_proj", qkv[:, qs + kvs :], h)
            q = apply_rope(qkv[:, :qs].view(-1, spec.num_heads, spec.head_dim), cos, sin)
            k = apply_rope(qkv[:, qs : qs + kvs].view(-1, spec.num_kv_heads, spec.head_dim), cos, sin)
            v = qkv[:, qs + kvs :].reshape(-1, spec.num_kv_heads, spec.head_dim)
            k_cache, v_cache = kv_caches[i]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k_cache, v_cache, meta, scale, spec.sliding_windows[i]).reshape(-1, qs)
            o = F.linear(attn, layer.o)
            if lora is not None:
                lora.add(i, "o_proj", o, attn)
            x = x + o
            h = rms_norm(x, layer.post_norm, spec.rms_norm_eps)
            gate_up = F.linear(h, layer.gate_up)
            if lora is not None:
                inter = spec.intermediate_size
                lora.add(i, "gate_proj", gate_up[:, :inter], h)
                lora.add(i, "up_proj", gate_up[:, inter:], h)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
            down = F.linear(act, layer.down)
            if lora is not None:
                lora.add(i, "down_proj", down, act)
            x = x + down
        x = rms_norm(x[logits_indices], self.norm, spec.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
