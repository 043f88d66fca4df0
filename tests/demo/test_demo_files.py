"""The demo build is a well-formed Hugging Face model directory plus PEFT adapters, and the cache guards it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from demo import DemoBuildError, verify_demo
from demo.recipe import ALL_PROJECTIONS, ATTENTION_MODULES


def test_model_dir_is_a_small_gqa_llama_with_tied_embeddings(demo_paths):
    model = Path(demo_paths["model"])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file(), name
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]          # GQA
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 512
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        n_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert 1_000_000 < n_params < 10_000_000, n_params
    assert dtypes == {"F32"}


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_tokenizer_loads_with_autotokenizer_and_has_a_chat_template(demo_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_paths["model"])
    cfg = json.loads((Path(demo_paths["model"]) / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg
    ids = tok("def f(x):\n    return x").input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token_id is not None
    assert tok.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"   # byte-level: lossless
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<s><|user|>\nhello\n<|assistant|>\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.convert_ids_to_tokens(ids[1]) == "<|user|>"   # role markers are single special tokens


def test_adapters_are_peft_safetensors_with_varied_ranks_and_targets(demo_paths):
    adapters = demo_paths["adapters"]
    assert len(adapters) >= 5
    ranks, targets = set(), set()
    for name, d in adapters.items():
        files = {p.name for p in Path(d).iterdir()}
        assert files == {"adapter_config.json", "adapter_model.safetensors"}, (name, files)
        cfg = json.loads((Path(d) / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
        ranks.add(cfg["r"])
        targets.add(tuple(sorted(cfg["target_modules"])))
        with safe_open(str(Path(d) / "adapter_model.safetensors"), "pt") as f:
            keys = list(f.keys())
        assert keys and all("lora_A" in k or "lora_B" in k for k in keys)
    assert {8, 16, 64} <= ranks
    assert tuple(sorted(ATTENTION_MODULES)) in targets and tuple(sorted(ALL_PROJECTIONS)) in targets


def test_manifest_matches_files_and_tampering_is_detected(demo_paths, tmp_path):
    root = Path(demo_paths["model"]).parent
    manifest = verify_demo(root)
    assert "model/model.safetensors" in manifest["sha256"]
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    cfg = copy / "adapters" / "upper" / "adapter_model.safetensors"
    data = bytearray(cfg.read_bytes())
    data[-1] ^= 0xFF
    cfg.write_bytes(bytes(data))
    with pytest.raises(DemoBuildError, match="does not match its manifest"):
        verify_demo(copy)
