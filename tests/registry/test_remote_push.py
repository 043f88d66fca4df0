"""`lora-registry push` to a remote control plane: the server runs as its own process in another working
directory (its own registry, blob store, upload area and allowed roots), mounted under /admin as in the Serve
app, and the CLI reaches it over loopback HTTP with the server root as --url. The files stream to the upload
area with a progress bar; a retried push reuses what was already uploaded."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

from registry.cli import main
from tests.fixtures.services import free_port
from tests.registry.adapter_kit import BASE, TEST_LIMITS, sha_map, start_control_plane

REPO = Path(__file__).resolve().parents[2]
@pytest.fixture
def remote(tmp_path):
    """-> (server root URL, server directory). The server process is stopped at teardown."""
    home = tmp_path / "server"
    (home / "incoming").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "REGISTRY_DB": str(home / "r.db"), "BLOB_DIR": str(home / "blobs"),
           "MATERIALIZE_DIR": str(home / "mat"), "UPLOAD_DIR": str(home / "uploads"),
           "ALLOWED_LOCAL_ROOTS": str(home / "incoming"), "REGISTRY_ADMIN_TOKEN": "tok",
           "LORASERVE_CACHE": str(home / "cache"), **{k.upper(): str(v) for k, v in TEST_LIMITS.items()}}
    for k in ("REDIS_URL", "S3_BUCKET", "REGISTRY_TOKENS"):
        env.pop(k, None)
    port = free_port()
    proc = start_control_plane(port, home, env)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, home
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_push_to_a_server_on_another_root_over_http(remote, capsys, adapter_templates, tiny_base, tmp_path,
                                                    monkeypatch):
    url, home = remote
    client_dir = tmp_path / "client"
    shutil.copytree(adapter_templates["a"], client_dir / "adapter")
    monkeypatch.chdir(client_dir)
    monkeypatch.delenv("LORA_REGISTRY_URL", raising=False)
    cli = ("--url", url, "--token", "tok")  # the server root: the CLI finds the control plane under /admin

    assert run(capsys, *cli, "base-model", BASE, str(tiny_base))[0] == 0
    code, rec, err = run(capsys, *cli, "push", "adapter", "--name", "remote-a", "--base-model", BASE, "--activate")
    assert code == 0, err
    assert rec["status"] == "active" and rec["version"] == 1
    assert "push remote-a" in err and "100%" in err  # the tqdm progress bar, on stderr
    # The files live on the server's side only: its upload area (the registered source) and its blob store.
    assert Path(rec["source_uri"]).parent == (home / "uploads").resolve()
    blobs = {p.name for p in (home / "blobs").rglob("*") if p.is_file()}
    assert set(sha_map(client_dir / "adapter").values()) <= blobs
    assert sorted(p.name for p in client_dir.iterdir()) == ["adapter"]

    # A retry (same files) reuses the upload and registers the next version; a broken upload stores nothing.
    sha = sha_map(client_dir / "adapter")
    bad = httpx.put(f"{url}/admin/v1/uploads/broken-upload-01/adapter_config.json", content=b"not the file",
                    headers={"Authorization": "Bearer tok", "X-Content-SHA256": sha["adapter_config.json"]})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "sha256_mismatch"
    assert not (home / "uploads" / "broken-upload-01").exists()  # a refused upload leaves nothing
    code, rec2, err = run(capsys, *cli, "push", "adapter", "--name", "remote-a", "--base-model", BASE)
    assert code == 0, err
    assert rec2["version"] == 2 and rec2["source_uri"] == rec["source_uri"]
    code, page, _ = run(capsys, "--url", url + "/admin", "--token", "tok", "list")  # the control plane's own root
    assert [(a["name"], a["active_version"], a["latest_version"]) for a in page["items"]] == [("remote-a", 1, 2)]


def test_push_refusal_and_unknown_server_are_reported(remote, capsys, adapter_templates, tiny_base, tmp_path):
    url, _ = remote
    assert run(capsys, "--url", url, "--token", "tok", "base-model", BASE, str(tiny_base))[0] == 0
    big = tmp_path / "big"
    shutil.copytree(adapter_templates["r16"], big)
    code, _, err = run(capsys, "--url", url, "--token", "tok", "push", str(big), "--name", "big", "--base-model", BASE)
    assert code == 1 and "HTTP 422" in err and "rank 16 is too high" in err
    code, page, _ = run(capsys, "--url", url, "--token", "tok", "list")
    assert page["items"] == []  # the refusal left nothing
    code, _, err = run(capsys, "--url", f"http://127.0.0.1:{free_port()}", "list")
    assert code == 1 and "no control plane" in err
    upload_id = hashlib.sha256(b"x").hexdigest()[:32]
    r = httpx.get(f"{url}/admin/v1/uploads/{upload_id}")
    assert r.status_code == 401
