"""docs/operator.md followed to the letter: every `bash` block of "Operating the registry" runs,
in order, in one shell (the installed `lora-registry` CLI and curl) against a control plane started as its own
process with default settings (but no blob grace period) under a fresh HOME, mounted at /admin as in the Serve
app. The only change made to the text is the port. Then the server is stopped the way the section says (SIGINT, i.e. Ctrl-C)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.fixtures.services import free_port
from tests.registry.adapter_kit import TEST_LIMITS, start_control_plane

REPO = Path(__file__).resolve().parents[2]
def operator_blocks() -> list[str]:
    text = (REPO / "docs" / "operator.md").read_text()
    section = text.split("# Operating the registry", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def _adapter(template: Path, dest: Path) -> None:
    shutil.copytree(template, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text()) | {"base_model_name_or_path": "demo"}
    (dest / "adapter_config.json").write_text(json.dumps(cfg))


def test_readme_operator_section_end_to_end(tmp_path, adapter_templates, tiny_base):
    blocks = operator_blocks()
    assert len(blocks) >= 7 and any("curl" in b for b in blocks) and any("lora-registry push" in b for b in blocks)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    shutil.copytree(tiny_base, work / "base-model")
    _adapter(adapter_templates["a"], work / "support-v1")
    _adapter(adapter_templates["b"], work / "support-v2")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REGISTRY", "REDIS", "S3_", "ALLOWED_",
                                                                      "LORA", "BLOB", "UPLOAD", "MATERIALIZE"))}
    env |= {"HOME": str(home), "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
            **{k.upper(): str(v) for k, v in TEST_LIMITS.items()}}
    port = free_port()
    # Default settings but one: no grace period for blobs, so the deletes' blob removal shows at once.
    server = start_control_plane(port, home, env | {"REGISTRY_ADMIN_TOKEN": "loraserve-admin-dev",
                                                    "BLOB_GC_GRACE_S": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        script = "\n".join(blocks).replace("http://127.0.0.1:8000", url)
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "push support" in done.stderr  # the progress bar

        auth = {"Authorization": "Bearer loraserve-admin-dev"}
        assert httpx.get(f"{url}/admin/v1/adapters/support", headers=auth).status_code == 404  # deleted
        audit = httpx.get(f"{url}/admin/v1/audit", headers=auth, params={"name": "support"}).json()
        assert [(e["action"], e["version"]) for e in audit] == [
            ("delete_adapter", None), ("delete_version", 2), ("enable", None), ("disable", None),
            ("rollback", None), ("promote", 2), ("canary", 2), ("register", 2), ("promote", 1), ("register", 1)]
        assert audit[-1]["details"]["source_uri"].startswith(str(home / ".cache/loraserve/registry/uploads"))
        assert audit[-3]["details"]["source_uri"] == str(home / ".cache/loraserve/incoming/support-v2")
        blobs = home / ".cache/loraserve/registry/blobs"
        assert not [p for p in blobs.rglob("*") if p.is_file()]  # the deletes took the blobs with them

        server.send_signal(signal.SIGINT)  # "Ctrl-C"
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
