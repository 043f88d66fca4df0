"""`lora-registry push` of a 50 MB adapter to the running Serve app (the session's, upload limit 64 MiB): the
control plane's uploads have their own limit, not the data plane's 2 MiB; a push killed mid-upload resumes
where the server's copy ends when it is run again; above the limit a 413, and the refused upload is gone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.deployments.serve_harness import ADMIN, UPLOAD_LIMIT

AUTH = {"Authorization": f"Bearer {ADMIN}"}
SIZE = 50 * 10**6  # bytes of the adapter's weights, about
ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def cli(serve_app, *args, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORA")}
    env |= {"LORA_REGISTRY_URL": serve_app.base_url, "LORA_REGISTRY_TOKEN": ADMIN}
    return subprocess.Popen([str(Path(sys.executable).parent / "lora-registry"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_a_50_mb_push_resumes_after_a_kill_and_the_limit_is_the_uploads_own(serve_app, tmp_path):
    big = tmp_path / "big"
    spec = serve_app.registry.get_base_model(serve_app.base_name)
    per_rank = 4 * spec.num_hidden_layers * sum(m.in_features + m.out_features for m in spec.modules.values())
    made = cli(serve_app, "init-example", str(big), "--base-model", serve_app.base_name, "--rank",
               str(SIZE // per_rank + 1), "--targets", ALL)
    assert made.wait(120) == 0, made.stderr.read()
    size = (big / "adapter_model.safetensors").stat().st_size
    assert 0.99 * SIZE < size < UPLOAD_LIMIT

    t0 = time.monotonic()
    first = cli(serve_app, "push", str(big), "--name", "big-push", "--base-model", serve_app.base_name)
    uploads = Path(serve_app.registry.settings.upload_dir)
    part = None
    while first.poll() is None and time.monotonic() - t0 < 120:  # kill it once a few MB reached the server
        parts = list(uploads.glob("*/.adapter_model.safetensors.*.part"))
        if parts and parts[0].stat().st_size > 4 * 2**20:
            part = parts[0]
            first.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    first.wait(30)
    assert part is not None, "the push finished before it could be killed"
    time.sleep(1.0)  # the server writes what had arrived
    held = part.stat().st_size
    assert 4 * 2**20 < held < size

    t1 = time.monotonic()
    second = cli(serve_app, "push", str(big), "--name", "big-push", "--base-model", serve_app.base_name)
    out, err = second.communicate(timeout=300)
    seconds = time.monotonic() - t1
    assert second.returncode == 0, err[-2000:]
    assert f"resuming adapter_model.safetensors at byte {held} of {size}" in err and "100%" in err
    state = serve_app.registry.get("big-push")
    assert state.versions[1].files["adapter_model.safetensors"].size == size  # whole, hash-checked
    print(f"\n50 MB push: {size} bytes, resumed at {held}, second run {seconds:.1f} s")

    # Over the limit: refused before a byte is read when the length is declared, and the upload is gone.
    path = "/admin/v1/uploads/too-big-upload/adapter_model.safetensors"
    host, port = serve_app.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # the headers alone, no body sent
        sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {AUTH['Authorization']}\r\n"
                     f"X-Content-SHA256: {'0' * 64}\r\nContent-Length: {UPLOAD_LIMIT + 1}\r\n\r\n".encode())
        answer = _response(sock)
    assert answer.startswith("HTTP/1.1 413") and "file_too_large" in answer, answer[:300]
    assert not (uploads / "too-big-upload").exists()
    url = serve_app.base_url + path
    # streamed without a declared length, it is cut off at the limit
    chunks = (b"\0" * 2**20 for _ in range(UPLOAD_LIMIT // 2**20 + 1))
    r = httpx.put(url, headers=AUTH | {"X-Content-SHA256": "0" * 64}, content=chunks, timeout=120)
    assert r.status_code == 413 and not (uploads / "too-big-upload").exists()
    audit = httpx.get(f"{serve_app.base_url}/admin/v1/audit", headers=AUTH, params={"name": "too-big-upload"}).json()
    assert [e["action"] for e in audit] == ["upload_rejected", "upload_rejected"]


def _response(sock: socket.socket) -> str:
    """One HTTP response, headers and its Content-Length body, however many reads it arrives in."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode(errors="replace")

