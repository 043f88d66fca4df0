"""A base model stored in the blob store with its files (config, tokenizer, safetensors weights): replicas
fetch it hash-verified, as they fetch adapters, so no pod needs a shared model volume."""

from __future__ import annotations

import shutil

import pytest

from registry import RegistryError, RegistryValidationError
from tests.registry.adapter_kit import sha_map


def test_uploaded_base_model_materializes_byte_for_byte(make_registry, backend, tiny_base):
    reg = make_registry(backend, register_base=False)
    spec = reg.register_base_model("stored", tiny_base, actor="ops", upload=True)
    assert set(spec.files) == set(sha_map(tiny_base)) >= {"config.json", "model.safetensors"}
    assert spec.blob_location == reg.blobs.location
    assert reg.get_base_model("stored").files == spec.files  # persisted in the metadata store
    local = reg.materialize_base("stored")
    got = sha_map(local)
    assert got.pop(".registry-verified.json") and got == sha_map(tiny_base)
    assert reg.materialize_base("stored") == local  # verified copy reused
    assert reg.audit("stored")[-1].action == "register_base_model"


def test_a_verified_base_model_copy_is_not_fetched_or_hashed_again(make_registry, tiny_base, monkeypatch):
    # what every replica (a replacement too) does at start-up on a node that already holds the model
    import registry.materialize as materialize

    reg = make_registry("sqlite+local", register_base=False)
    reg.register_base_model("stored", tiny_base, upload=True)
    local = reg.materialize_base("stored")
    calls = []
    monkeypatch.setattr(reg.blobs, "get", lambda *a, **kw: calls.append("get"))
    monkeypatch.setattr(materialize, "sha256_file", lambda *a, **kw: calls.append("hash"))
    assert reg.materialize_base("stored") == local and calls == []


def test_garbage_collection_spares_base_model_blobs(make_registry, backend, tiny_base):
    reg = make_registry(backend, register_base=False, blob_gc_grace_s=0)
    spec = reg.register_base_model("stored", tiny_base, upload=True)
    assert reg.collect_garbage(grace_s=0) == []
    assert all(reg.blobs.exists(f.sha256) for f in spec.files.values())


def test_base_model_without_files_names_the_fix(make_registry, tiny_base):
    reg = make_registry("sqlite+local", register_base=False)
    reg.register_base_model("config-only", tiny_base)
    with pytest.raises(RegistryError, match="--upload") as err:
        reg.materialize_base("config-only")
    assert err.value.code == "no_base_files"


def test_corrupt_base_blob_is_refused(make_registry, tiny_base, tmp_path):
    reg = make_registry("sqlite+local", register_base=False)
    spec = reg.register_base_model("stored", tiny_base, upload=True)
    digest = spec.files["model.safetensors"].sha256
    blob = next((tmp_path).glob(f"blobs-*/sha256/{digest[:2]}/{digest}"))
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match="corrupt") as err:
        reg.materialize_base("stored")
    assert err.value.code == "corrupt_blob"


@pytest.mark.parametrize("extra,code", [("pytorch_model.bin", "unsafe_file_type"), (None, "missing_file")])
def test_unsafe_or_incomplete_model_dirs_are_refused(make_registry, tiny_base, tmp_path, extra, code):
    reg = make_registry("sqlite+local", register_base=False)
    bad = tmp_path / "bad-model"
    shutil.copytree(tiny_base, bad)
    if extra:
        (bad / extra).write_bytes(b"\x80\x04pickle")
    else:
        (bad / "model.safetensors").unlink()
    with pytest.raises(RegistryValidationError) as err:
        reg.register_base_model("bad", bad, upload=True)
    assert err.value.code == code
    assert reg.blobs.list() == [] and reg.list_base_models() == []
