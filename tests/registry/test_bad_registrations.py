"""Bad registrations through the REST API are refused with a 4xx naming the problem and leave nothing behind:
no adapter, no version, no version number used, no blob; only a `register_rejected` audit entry with the reason.
Thirty of them in a row leave the listing and the version counter as they were."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from registry.api import create_app
from tests.registry.adapter_kit import BASE, sha_map

W = "adapter_model.safetensors"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
ADMIN = {"Authorization": "Bearer admin-token"}


def _edit_config(**changes) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(changes)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return mutate


def _edit_tensor(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        tensors = load_file(d / W)
        fn(tensors)
        save_file(tensors, d / W)
    return mutate


def _raw_header(header: bytes, length: int | None = None, data: bytes = b"") -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        (d / W).write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return mutate


def _set(tensors: dict, name: str, value) -> None:
    tensors[name] = value


def _poison(value: float) -> Callable[[dict], None]:
    def fn(t: dict) -> None:
        t[Q_A] = t[Q_A].clone()
        t[Q_A][0, 3] = value
    return fn


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(data)


def _symlink_out(target: Path) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        (d / "adapter_config.json").unlink()
        os.symlink(target, d / "adapter_config.json")
    return mutate


def _extra_files(n: int) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        for i in range(n):
            (d / f"extra{i}.safetensors").write_bytes((d / W).read_bytes())
    return mutate


def _rm(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


# id -> (template, mutate, uri transform, sha256 transform, base model, expected code, words in the message)
CASES = {
    "dotdot_traversal": ("a", None, lambda u, r, b: f"{r}/../{Path(u).name}", None, BASE, "path_traversal", "traversal"),
    "absolute_outside_root": ("a", None, lambda u, r, b: str(b), None, BASE, "path_traversal", "outside"),
    "symlink_out": ("a", "symlink", None, None, BASE, "path_traversal", "symlink"),
    "http_scheme": ("a", None, lambda u, r, b: "http://example.com/adapters/x", None, BASE, "scheme_not_allowed", "http"),
    "file_scheme": ("a", None, lambda u, r, b: f"file://{u}", None, BASE, "scheme_not_allowed", "file"),
    "bucket_not_allowed": ("a", None, lambda u, r, b: "s3://evil-bucket/uploads/x", None, BASE, "bucket_not_allowed",
                           "not allowed"),
    "missing_config": ("a", _rm("adapter_config.json"), None, None, BASE, "missing_config", "adapter_config.json"),
    "malformed_config": ("a", _write("adapter_config.json", b"{r: 4,"), None, None, BASE, "bad_config", "malformed"),
    "wrong_field_types": ("a", _edit_config(r="4", target_modules=[1, 2]), None, None, BASE, "bad_config", "'r'"),
    "unknown_base_model": ("a", None, None, None, "no-such-model", "unknown_base_model", "no-such-model"),
    "base_model_mismatch": ("a", _edit_config(base_model_name_or_path="meta-llama/Llama-2-7b-hf"), None, None, BASE,
                            "base_model_mismatch", "Llama-2-7b"),
    "rank_too_high": ("r16", None, None, None, BASE, "rank_too_high", "rank 16"),
    "unknown_target_module": ("a", _edit_config(target_modules=["q_proj", "W_pack"]), None, None, BASE,
                              "unknown_target_module", "W_pack"),
    "tensor_shape_mismatch": ("a", _edit_tensor(lambda t: _set(t, Q_A, torch.zeros(4, 32))), None, None, BASE,
                              "shape_mismatch", "[4, 32]"),
    "tensor_dtype": ("a", _edit_tensor(lambda t: _set(t, Q_A, torch.zeros(4, 64, dtype=torch.int32))), None, None,
                     BASE, "dtype_mismatch", "I32"),
    "unexpected_tensor": ("a", _edit_tensor(lambda t: _set(t, "base_model.model.lm_head.weight", torch.zeros(2, 2))),
                          None, None, BASE, "tensor_mismatch", "lm_head"),
    "nan": ("a", _edit_tensor(_poison(float("nan"))), None, None, BASE, "non_finite", "NaN"),
    "inf": ("a", _edit_tensor(_poison(float("inf"))), None, None, BASE, "non_finite", "Inf"),
    "sha256_mismatch": ("a", None, None, lambda s: s | {W: "0" * 64}, BASE, "sha256_mismatch", "sha256 mismatch"),
    "sha256_undeclared": ("a", None, None, lambda s: {k: v for k, v in s.items() if k != W}, BASE, "sha256_missing",
                          W),
    "bin_file": ("a", _write("adapter_model.bin", b"\x80\x02pickle"), None, None, BASE, "unsafe_file_type", ".bin"),
    "pt_file": ("a", _write("weights.pt", b"\x80\x02pickle"), None, None, BASE, "unsafe_file_type", "pickle"),
    "oversize_file": ("a", _write("README.md", b"x" * (300 * 1024)), None, None, BASE, "file_too_large", "oversize"),
    "too_many_files": ("a", _extra_files(3), None, None, BASE, "too_many_files", "too many files"),
    "absurd_header_length": ("a", _raw_header(b"{}", length=2**62), None, None, BASE, "bad_safetensors",
                             "header length"),
    "header_not_json": ("a", _raw_header(b"{not json!"), None, None, BASE, "bad_safetensors", "not valid JSON"),
    "header_offsets_out_of_range": ("a", _raw_header(json.dumps(
        {Q_A: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}}).encode(), data=b"\0" * 16), None, None,
        BASE, "bad_safetensors", "outside"),
    "truncated_file": ("a", _write(W, b"\x01\x02"), None, None, BASE, "bad_safetensors", "shorter"),
    "gapped_offsets": ("a", _raw_header(json.dumps(
        {Q_A: {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}).encode(), data=b"\0" * 24), None, None,
        BASE, "bad_safetensors", "gap in data_offsets"),
    "trailing_bytes": ("a", _raw_header(json.dumps(
        {Q_A: {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode(), data=b"\0" * 20), None, None,
        BASE, "bad_safetensors", "trailing bytes"),
    "nested_metadata": ("a", lambda d: _nest_metadata(d), None, None, BASE, "bad_safetensors", "__metadata__"),
    "deeply_nested_config": ("a", _write("adapter_config.json", b"[" * 100_000 + b"]" * 100_000), None, None, BASE,
                             "bad_config", "malformed"),
    "infinite_alpha_pattern": ("a", _edit_config(alpha_pattern={"q_proj": float("inf")}), None, None, BASE,
                               "bad_config", "alpha_pattern"),
}


def _nest_metadata(d: Path) -> None:
    """The real file with its __metadata__ turned into a nested object (offsets untouched)."""
    raw = (d / W).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"format": "pt", "nested": {"a": 1}}
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    (d / W).write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.fixture
def client_and_reg(make_registry, backend):
    reg = make_registry(backend)
    return TestClient(create_app(reg, {"admin-token": {"role": "admin", "name": "root"}})), reg


def _snapshot(reg) -> tuple:
    return (reg.list_states(), reg.blobs.list(), reg.list_page(None, 1000))


def _bad_request(case, stage, incoming_root, tiny_base) -> dict:
    template, mutate, uri_fn, sha_fn, base, code, words = CASES[case]
    src = stage(template, None if mutate == "symlink" else mutate)
    sha = sha_map(src)  # hashes of the files as they are, so only the intended defect is wrong
    if mutate == "symlink":
        _symlink_out(tiny_base / "config.json")(src)
    uri = uri_fn(str(src), str(incoming_root), tiny_base) if uri_fn else str(src)
    return {"name": "keep", "source_uri": uri, "sha256": sha_fn(sha) if sha_fn else sha, "base_model": base}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_registration_refused_and_leaves_nothing(case, client_and_reg, stage, incoming_root, tiny_base):
    client, reg = client_and_reg
    # A healthy, active adapter of the same name that must come out untouched.
    good = stage("b")
    assert client.post("/v1/adapters", headers=ADMIN, json={"name": "keep", "source_uri": str(good),
                       "sha256": sha_map(good), "base_model": BASE, "activate": True}).status_code == 201
    body = _bad_request(case, stage, incoming_root, tiny_base)
    before, rev = _snapshot(reg), reg.revision()

    resp = client.post("/v1/adapters", headers=ADMIN, json=body)

    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    code, words = CASES[case][5:]
    assert err["code"] == code and words in err["message"], err
    assert _snapshot(reg) == before  # no version, no blob, nothing else changed
    (entry,) = reg.audit(after_seq=rev)
    assert (entry.action, entry.name, entry.version) == ("register_rejected", "keep", None)
    assert entry.details["code"] == code and entry.details["reason"] == err["message"]


def test_thirty_bad_registrations_then_a_good_one_gets_the_next_version(client_and_reg, stage, incoming_root,
                                                                        tiny_base):
    client, reg = client_and_reg
    good = stage("a")
    for _ in range(2):
        assert client.post("/v1/adapters", headers=ADMIN, json={"name": "keep", "source_uri": str(good),
                           "sha256": sha_map(good), "base_model": BASE}).status_code == 201
    before = _snapshot(reg)
    listing = client.get("/v1/adapters", headers=ADMIN).json()
    cases = sorted(CASES)[:30]
    assert len(cases) == 30
    for case in cases:
        assert 400 <= client.post("/v1/adapters", headers=ADMIN,
                                  json=_bad_request(case, stage, incoming_root, tiny_base)).status_code < 500
    assert _snapshot(reg) == before and client.get("/v1/adapters", headers=ADMIN).json() == listing
    resp = client.post("/v1/adapters", headers=ADMIN, json={"name": "keep", "source_uri": str(good),
                       "sha256": sha_map(good), "base_model": BASE})
    assert resp.status_code == 201 and resp.json()["version"] == 3


@pytest.mark.parametrize("name", ["../evil", "a/b", "", "x" * 65, "base:adapter", "-dash"])
def test_invalid_name_refused_with_audit_only(name, client_and_reg, stage):
    client, reg = client_and_reg
    src = stage("a")
    rev = reg.revision()
    resp = client.post("/v1/adapters", headers=ADMIN, json={"name": name, "source_uri": str(src),
                       "sha256": sha_map(src), "base_model": BASE})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_name"
    assert "invalid adapter name" in resp.json()["error"]["message"]
    assert reg.list_states() == [] and reg.blobs.list() == [] and reg.list_page() == []
    (entry,) = reg.audit(after_seq=rev)
    assert entry.action == "register_rejected" and entry.actor == "root"


def test_registering_for_a_base_model_with_other_shapes_is_refused(client_and_reg, stage, tiny_base):
    client, reg = client_and_reg
    cfg = json.loads((tiny_base / "config.json").read_text()) | {"hidden_size": 96, "head_dim": 24}
    assert client.post("/v1/base-models", headers=ADMIN, json={"name": "tiny-llama-wide", "config": cfg}).status_code == 201
    src = stage("a", _edit_config(base_model_name_or_path="tiny-llama-wide"))
    resp = client.post("/v1/adapters", headers=ADMIN, json={"name": "w", "source_uri": str(src),
                       "sha256": sha_map(src), "base_model": "tiny-llama-wide"})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "shape_mismatch"


# Refused for the body's shape, before any file is read: audited all the same.
SCHEMA_CASES = {
    "extra_field": {"colour": "red"},
    "activate_as_string": {"activate": "true"},
    "sha256_as_list": {"sha256": ["abc"]},
    "name_as_number": {"name": 7},
    "visibility_unknown": {"visibility": "secret"},
    "tenant_as_number": {"tenant": 3},
    "labels_not_strings": {"labels": {"k": 1}},
    "too_many_labels": {"labels": {f"k{i}": "v" for i in range(40)}},
    "label_value_too_long": {"labels": {"k": "v" * 300}},
    "description_too_long": {"description": "d" * 5000},
}
UPLOADED = sorted(c for c, v in CASES.items() if v[2] is None and v[1] != "symlink"
                  and c not in ("oversize_file", "too_many_files"))


def _upload(client, upload_id: str, src: Path) -> str:
    for p in sorted(src.iterdir()):
        r = client.put(f"/v1/uploads/{upload_id}/{p.name}", content=p.read_bytes(),
                       headers=ADMIN | {"X-Content-SHA256": sha_map(src)[p.name]})
        assert r.status_code == 200, r.text
    return client.get(f"/v1/uploads/{upload_id}", headers=ADMIN).json()["source_uri"]


def test_thirty_refusals_of_every_kind_leave_no_record_no_blob_the_uploads_to_retry_and_an_audit_entry_each(
        client_and_reg, stage, incoming_root, tiny_base):
    client, reg = client_and_reg
    uploads = Path(reg.settings.upload_dir)
    states, refused = reg.list_states(), []
    for i, case in enumerate(UPLOADED):  # files pushed to the upload area, then a registration refused for them
        template, mutate, _, sha_fn, base, code, _ = CASES[case]
        src = stage(template, mutate)
        uri = _upload(client, f"refused-{i:03d}", src)
        sha = sha_map(src)
        r = client.post("/v1/adapters", headers=ADMIN, json={"name": f"up-{i}", "source_uri": uri, "base_model": base,
                                                             "sha256": sha_fn(sha) if sha_fn else sha})
        refused.append((case, r.status_code, r.json()["error"]["code"], f"up-{i}", "register_rejected"))
    good = stage("a")
    for i, (case, extra) in enumerate(sorted(SCHEMA_CASES.items())):
        uri = _upload(client, f"schema-{i:03d}", good)
        body = {"name": f"sc-{i}", "source_uri": uri, "sha256": sha_map(good), "base_model": BASE} | extra
        r = client.post("/v1/adapters", headers=ADMIN, json=body)
        name = body["name"] if isinstance(body["name"], str) else "-"
        refused.append((case, r.status_code, r.json()["error"]["code"], name, "register_rejected"))
    # uploads refused themselves: a wrong hash, a file over the limit, one file too many
    sha = sha_map(good)
    r = client.put("/v1/uploads/bad-hash-01/adapter_config.json", content=b"{}",
                   headers=ADMIN | {"X-Content-SHA256": sha["adapter_config.json"]})
    refused.append(("upload_sha256_mismatch", r.status_code, r.json()["error"]["code"], "bad-hash-01",
                    "upload_rejected"))
    r = client.put("/v1/uploads/too-big-01/adapter_model.safetensors", content=b"\0" * (300 * 1024),
                   headers=ADMIN | {"X-Content-SHA256": "0" * 64})
    refused.append(("upload_too_large", r.status_code, r.json()["error"]["code"], "too-big-01", "upload_rejected"))
    for n in range(5):
        r = client.put(f"/v1/uploads/too-many-01/extra{n}.safetensors", content=b"x",
                       headers=ADMIN | {"X-Content-SHA256": hashlib.sha256(b"x").hexdigest()})
    refused.append(("upload_too_many_files", r.status_code, r.json()["error"]["code"], "too-many-01",
                    "upload_rejected"))

    assert len(refused) >= 30
    assert all(400 <= status < 500 for _, status, _, _, _ in refused), refused
    assert [status for case, status, _, _, _ in refused if case.startswith("upload_too_large")] == [413]
    # a refused registration leaves its upload session for the corrected one; a refused file leaves nothing of
    # itself (too-many-01 keeps the files it took before the one too many)
    sessions = [f"refused-{i:03d}" for i in range(len(UPLOADED))] + [f"schema-{i:03d}" for i in range(len(SCHEMA_CASES))]
    assert sorted(p.name for p in uploads.iterdir()) == sorted(sessions + ["too-many-01"])
    assert not [p for p in uploads.rglob(".*.part")]
    assert reg.list_states() == states and reg.blobs.list() == []  # no record, no blob
    audit = reg.audit(limit=1000)  # oldest first
    rejected = [(e.name, e.action, e.details["code"]) for e in audit if e.action.endswith("_rejected")]
    assert rejected == [(name, action, code) for _, _, code, name, action in refused]
