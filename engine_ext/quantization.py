"""How the base model's linear weights are stored and multiplied: dense (the model's dtype) or FP8.

FP8 (`EngineConfig.quantization="fp8"`): each of a decoder layer's products (q/k/v, o, gate/up, down) keeps its
weight as float8 e4m3 (`torch.float8_e4m3fn`) with one float32 scale per output channel (row):

    scale[o] = max_i |W[o, i]| / 448        W8[o, i] = round_e4m3(W[o, i] / scale[o])
    y = x @ W.T + bias  ~=  (x @ float(W8).T) * scale + bias

Embeddings, norms, the LM head, the LoRA A/B stacks and the KV cache stay in the model's dtype.

The model calls its `WeightFormat` for every layer product (`DecoderLayer` holds the format's weight objects and its
`linear`), so a kernel plugs in at one place: `Fp8Weights(matmul=...)`, where `matmul(x, w8, scale, bias)` has the
contract of `fp8_linear` below, the plain-torch reference (CPUs, and GPUs without the Triton layer ops); on a GPU
the engine's Triton layer ops bring a W8A16 GEMM (kernels/triton_fp8.py). The reference turns the FP8 bytes into the activations' dtype for each
product (nothing cached: the weights stay at one byte a parameter) and multiplies in that dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .constants import LORA_MODULES
from .model_config import ModelLoadError

# The engine's `quantization` choices (None: dense weights in the model's dtype)
QUANTIZATIONS = ("fp8",)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# FP8 matrix products need tensor cores of compute capability 8.9 (Ada) or 9.0 (Hopper) and later
FP8_MIN_CAPABILITY = (8, 9)
# A decoder layer's projection weight, as Hugging Face checkpoints name it
LINEAR_WEIGHT = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(" + "|".join(LORA_MODULES) + r")\.weight$")
SCALE_SUFFIX = "_scale"  # "<module>.weight_scale": the checkpoint's name of a weight's scales


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight (any float dtype) -> (W8 [out, in] float8_e4m3fn, scale [out] float32), per output channel:
    scale = absmax(row) / 448 (1 for an all-zero row), W8 = e4m3(row / scale), computed in float32."""
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    if not torch.isfinite(absmax).all():
        raise ValueError("weights with NaN or Inf cannot be quantized")
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_values(w8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn -> `dtype`, exact (every finite e4m3 value is a bfloat16, float16 and float32 value).

    Bitwise: an e4m3 byte's exponent and mantissa, moved into bfloat16's fields (8 exponent bits, bias 127 against
    e4m3's 7), read as a bfloat16 and multiplied by 2**120 (exact); e4m3 subnormals land on bfloat16 subnormals, so the
    same product rescales them (this assumes denormals are not flushed, torch's default). About 3x faster on a CPU
    than `w8.to(dtype)`. The NaN bytes (0x7F, 0xFF) come out finite: callers refuse them at load (`check_fp8`)."""
    b = w8.view(torch.uint8).to(torch.int16)
    sign = (b & 0x80) << 8
    b &= 0x7F
    b <<= 4
    b |= sign
    v = b.view(torch.bfloat16)
    v *= 2.0**120  # in bfloat16, whose exponent range holds both factors (float16's does not)
    return v.to(dtype)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """y = (x @ float(w8).T) * scale + bias: x [T, in], w8 [out, in] e4m3, scale [out] float32, bias [out] or None.
    The plain-torch reference: each call widens the weight to x's dtype (on a CPU, float32) and multiplies."""
    y = F.linear(x, fp8_values(w8, x.dtype))
    y = (y.float() * scale).to(x.dtype)
    return y if bias is None else y + bias


def check_fp8(name: str, w8: torch.Tensor) -> None:
    """Raise ModelLoadError when a checkpoint's FP8 weight is not e4m3fn or holds NaN bytes."""
    if w8.dtype != FP8_DTYPE:
        raise ModelLoadError(f"{name}: weights stored as {w8.dtype} are not supported (FP8 checkpoints must store "
                             f"{FP8_DTYPE}, e4m3)")
    if ((w8.view(torch.uint8) & 0x7F) == 0x7F).any():
        raise ModelLoadError(f"{name}: FP8 weight holds NaN")


def check_fp8_device(device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """Raise ValueError when `device` cannot run FP8 weights: a CUDA GPU of compute capability below 8.9.
    capability: the GPU's (major, minor), read from the device when None. A CPU runs the reference (fp8_linear)."""
    if device.type != "cuda":
        return
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "the GPU"
        raise ValueError(f"quantization='fp8' needs a GPU with FP8 support (compute capability >= 8.9: Ada, Hopper "
                         f"or later); {device} ({name}) has {capability[0]}.{capability[1]}. Serve it with "
                         f"quantization=None (bfloat16 weights)")


class Fp8Linear(nn.Module):
    """One fused product's FP8 weight: W8 [out, in] float8_e4m3fn and its per-output-channel scale [out] float32."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)


class WeightFormat(Protocol):
    """How a decoder layer's product weights are held, loaded and multiplied (DenseWeights, Fp8Weights).

    empty(out, in, dtype) -> the weight object a layer holds for one fused product
    prepare(name, tensor) -> the (name, tensor) pairs a checkpoint tensor becomes (before a rank takes its part)
    part(take, prefix) -> one module's weight from the prepared tensors (`take(name)` pops one)
    copy_(weight, parts) -> the fused product's weight from its modules' parts, in output order
    linear(x, weight, bias) -> x @ W.T + bias"""

    def empty(self, out_features: int, in_features: int, dtype: torch.dtype): ...
    def prepare(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]: ...
    def part(self, take: Callable[[str], torch.Tensor], prefix: str): ...
    def copy_(self, weight, parts: list) -> None: ...
    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class DenseWeights:
    """Weights in the model's dtype, multiplied by the layer ops' `linear` (F.linear)."""

    def __init__(self, linear: Callable = F.linear):
        self.linear = linear

    def empty(self, out_features: int, in_features: int, dtype: torch.dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def prepare(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield name, tensor

    def part(self, take: Callable[[str], torch.Tensor], prefix: str) -> torch.Tensor:
        return take(prefix + ".weight")

    def copy_(self, weight: nn.Parameter, parts: list[torch.Tensor]) -> None:
        weight.copy_(torch.cat(parts))


class Fp8Weights:
    """FP8 weights with per-output-channel scales (the module docstring), quantized as the checkpoint is read unless it
    stores them so already (`prepare`). matmul(x, w8, scale, bias): fp8_linear's contract."""

    def __init__(self, matmul: Callable = fp8_linear):
        self.matmul = matmul

    @classmethod
    def for_device(cls, device: torch.device, capability: tuple[int, int] | None = None,
                   matmul: Callable | None = None) -> Fp8Weights:
        """The format on `device`, refused (ValueError) on a GPU without FP8 support. matmul: the device's kernel
        (kernels.triton_fp8.fp8_linear_triton on a GPU with the Triton layer ops), else the reference."""
        check_fp8_device(device, capability)
        return cls(matmul or fp8_linear)

    def empty(self, out_features: int, in_features: int, dtype: torch.dtype) -> Fp8Linear:
        return Fp8Linear(out_features, in_features)

    def prepare(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A dense projection weight -> its W8 and scales (quantized over whole rows, before a tensor-parallel rank
        slices them, so every rank holds the one-rank model's values); anything else passes as it is."""
        # stored quantized (e4m3; int8, e5m2 and other 8-bit formats are refused by name in part()) or not a weight
        if LINEAR_WEIGHT.match(name) is None or not tensor.is_floating_point() or tensor.element_size() == 1:
            yield name, tensor
            return
        try:
            w8, scale = quantize_fp8(tensor)
        except ValueError as e:
            raise ModelLoadError(f"{name}: {e}") from None
        yield name, w8
        yield name + SCALE_SUFFIX, scale

    def part(self, take: Callable[[str], torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        name = prefix + ".weight"
        w8 = take(name)
        check_fp8(name, w8)
        scale = take(name + SCALE_SUFFIX).float().reshape(-1)
        if scale.numel() == 1:  # a per-tensor scale: the same value for every channel, exactly
            scale = scale.expand(w8.shape[0])
        if scale.numel() != w8.shape[0]:
            raise ModelLoadError(f"{name}{SCALE_SUFFIX}: {scale.numel()} scales for {w8.shape[0]} output channels "
                                 "(per-channel or per-tensor scales are supported)")
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise ModelLoadError(f"{name}{SCALE_SUFFIX}: scales must be finite and positive")
        return w8, scale

    def copy_(self, weight: Fp8Linear, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        weight.weight.copy_(torch.cat([w8 for w8, _ in parts]))
        weight.scale.copy_(torch.cat([scale for _, scale in parts]))

    def linear(self, x: torch.Tensor, weight: Fp8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.matmul(x, weight.weight, weight.scale, bias)


def weight_format(quantization: str | None, device: torch.device, linear: Callable = F.linear,
                  fp8_matmul: Callable | None = None) -> WeightFormat:
    """The format an engine's config asks for on `device` (linear: the layer ops' dense product; fp8_matmul: the FP8
    product's kernel, None for the reference)."""
    if quantization is None:
        return DenseWeights(linear)
    if quantization == "fp8":
        return Fp8Weights.for_device(device, matmul=fp8_matmul)
    raise ValueError(f"unknown quantization {quantization!r}; choose one of {[None, *QUANTIZATIONS]}")
