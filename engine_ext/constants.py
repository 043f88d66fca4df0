"""Layer and module names, in one place (PEFT and Hugging Face spell them this way)."""

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTN_MODULES + MLP_MODULES
# Projections sharing one input whose base matrices are fused (q/k/v, gate/up): their LoRA deltas are
# applied by one batched op over the fused output, each module on its own column segment.
LORA_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
               "down": ("down_proj",)}

# Which sub-block of a decoder layer owns each projection.
MODULE_PARENT = {m: "self_attn" for m in ATTN_MODULES} | {m: "mlp" for m in MLP_MODULES}

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
