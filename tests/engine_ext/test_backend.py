"""The kernels an engine runs are chosen once from its EngineConfig (backend.Backend) and the model is built
with its element-wise ops; only ops that fold LoRA take the LoRA math, and only for decode and verify-sized forwards."""

from types import SimpleNamespace

import pytest
import torch

from engine_ext import EngineConfig, KernelSettings
from engine_ext.backend import Backend
from engine_ext.lora_ops import add_lora_dense, add_lora_reference
from engine_ext.model import CausalLM, TorchOps
from engine_ext.model_config import ModelSpec, RopeSpec

SPEC = ModelSpec(architecture="LlamaForCausalLM", vocab_size=31, hidden_size=32, intermediate_size=48, num_layers=2,
                 num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope=RopeSpec(theta=1e4),
                 tie_word_embeddings=True, max_position_embeddings=64, sliding_windows=(None,) * 2,
                 eos_token_ids=(0,))
GROUPED = SimpleNamespace(groups={}, rank=16)  # a rank-16 LoRABatch with the slots' fused group stacks
GROUPED64 = SimpleNamespace(groups={}, rank=64)


@pytest.mark.parametrize("lora_backend,op", [("torch", add_lora_dense), ("gather", add_lora_reference)])
def test_the_plain_torch_backend(tmp_path, lora_backend, op):
    backend = Backend.from_config(EngineConfig(model=str(tmp_path), lora_backend=lora_backend), torch.device("cpu"))
    assert isinstance(backend.layer_ops, TorchOps)
    assert backend.lora_op is op and backend.group_lora_op is None and backend.attention is None


def test_torch_ops_never_fold_lora():
    model = CausalLM(SPEC, torch.float32, TorchOps())
    assert not model.folds_lora(GROUPED, 1, False)
    assert not model.folds_lora(GROUPED, 8, True)


class _FoldingOps(TorchOps):
    """Ops that fold LoRA by the Triton ops' rule (KernelSettings.folds_lora), verify forwards of up to 1,024 tokens x
    rank (64 tokens at rank 16, 16 at rank 64)."""

    fuses_lora = True

    @staticmethod
    def folds_lora(num_tokens, multi, rank):
        return KernelSettings(fold_multi_token_ranks=1024).folds_lora(num_tokens, multi, rank)


@pytest.mark.parametrize("lora,tokens,multi,folds", [
    (GROUPED, 4, False, True),  # decode
    (GROUPED, 32, False, True),
    (GROUPED, 33, False, False),  # decode past one wave of programs: the group op after each product
    (GROUPED, 10, True, True),  # a verify pass (several tokens of a sequence)
    (GROUPED, 64, True, True),
    (GROUPED, 65, True, False),  # past fold_multi_token_ranks (a long prefill): the group op after each product
    (GROUPED64, 16, True, True),  # a higher rank folds fewer tokens
    (GROUPED64, 17, True, False),
    (GROUPED64, 32, False, True),  # decode's bound does not depend on the rank
    (SimpleNamespace(groups=None), 1, False, False),  # no fused group stacks to pass
    (None, 1, False, False),  # no adapters in the batch
])
def test_folding_ops_take_the_lora_math_of_decode_and_verify_sized_forwards(lora, tokens, multi, folds):
    model = CausalLM(SPEC, torch.float32, _FoldingOps())
    assert model.folds_lora(lora, tokens, multi) is folds
