"""A model directory's `quantization_config` (config.json), read and checked against the engine's `quantization`.

Served: `quant_method: "fp8"` as vLLM and transformers write it, weight-only as far as the engine is concerned:

    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    model.layers.0.self_attn.q_proj.weight         float8_e4m3fn [out, in]
    model.layers.0.self_attn.q_proj.weight_scale   float32 [out], [out, 1] (per channel) or [] / [1] (per tensor)

Refused by name at start-up, since serving them as if they were this format would give another model: every other
`quant_method` (gptq, awq, compressed-tensors, bitsandbytes, ...), block-wise scales (`weight_block_size`, with
`weight_scale_inv` tensors), another element format (`fmt` other than e4m3; int8 or e5m2 tensors are refused as the
weights load, quantization.check_fp8), static activation scales (`activation_scheme: "static"`, `input_scale`
tensors), a quantized KV cache (`kv_cache_scheme`), decoder projections left out of quantization (`ignored_layers`
naming them: the engine holds every projection in one format), and fields this reader does not know.
"""

from __future__ import annotations

import json
import os

from .constants import LORA_MODULES
from .model_config import ModelLoadError

# Fields of an "fp8" quantization_config and the values served; a field absent counts as its served value
_KNOWN_FIELDS = ("quant_method", "activation_scheme", "ignored_layers", "modules_to_not_convert",
                 "weight_block_size", "fmt", "kv_cache_scheme")


def checkpoint_quantization(model_dir: str) -> str | None:
    """The quantization a model directory's weights are stored in: "fp8", or None for dense weights. Raises
    ModelLoadError naming the scheme or field for a quantized checkpoint the engine cannot serve exactly."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None  # load_model_spec reports the missing config
    with open(path) as f:
        qc = json.load(f).get("quantization_config")
    if qc is None:
        return None
    where = f"{path}: quantization_config"
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where} must be a mapping, got {qc!r}")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(f"{where}: quant_method {method!r} is not supported (served: 'fp8', e4m3 weights with "
                             "per-channel or per-tensor scales)")
    unknown = sorted(set(qc) - set(_KNOWN_FIELDS))
    if unknown:
        raise ModelLoadError(f"{where}: unknown field(s) {unknown} (known: {list(_KNOWN_FIELDS)})")
    if qc.get("weight_block_size") is not None:
        raise ModelLoadError(f"{where}: block-wise scales (weight_block_size {qc['weight_block_size']}) are not "
                             "supported; per-channel or per-tensor scales are")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{where}: fmt {qc['fmt']!r} is not supported (served: 'e4m3')")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(f"{where}: activation_scheme {qc['activation_scheme']!r} is not supported (static "
                             "activation scales, input_scale); served: 'dynamic'")
    if qc.get("kv_cache_scheme") is not None:
        raise ModelLoadError(f"{where}: kv_cache_scheme is not supported (the KV cache stays in the model's dtype)")
    for field in ("ignored_layers", "modules_to_not_convert"):
        kept = [m for m in qc.get(field) or [] if m.rsplit(".", 1)[-1] in LORA_MODULES]
        if kept:
            raise ModelLoadError(f"{where}: {field} names decoder projections {kept[:3]}: the engine holds every "
                                 "projection in FP8 (the embeddings and lm_head stay dense)")
    return "fp8"


def check_checkpoint(quantization: str | None, model_dir: str) -> None:
    """Raise ModelLoadError when the engine's `quantization` cannot serve the checkpoint's weights: a quantized
    checkpoint needs the same quantization (a dense one serves with any: FP8 quantizes it as it loads)."""
    stored = checkpoint_quantization(model_dir)
    if stored is not None and quantization != stored:
        raise ModelLoadError(f"{model_dir}: its weights are stored as {stored} (quantization_config); serve it with "
                             f"quantization={stored!r}, not {quantization!r}")
