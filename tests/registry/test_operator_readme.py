"""docs/operator.md, followed to the letter: every `bash` block runs, in order, in one shell (the installed
`lora-registry` CLI, curl, python3) in an empty directory, against the session's Serve app (what `serve run
deployments.app` starts, with the development credentials). The only change made to the text is the port."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.deployments.serve_harness import ADMIN

REPO = Path(__file__).resolve().parents[2]


def operator_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "operator.md").read_text(), flags=re.S)


def test_operator_walk_runs_as_printed_from_an_empty_directory(serve_app, tmp_path):
    blocks = operator_blocks()
    assert len(blocks) >= 8 and any("curl" in b for b in blocks) and any("lora-registry push" in b for b in blocks)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORA", "OPENAI", "REGISTRY"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    # the walk as printed, against the test's app: its URL, and its base model (the quick toy demo, "demo")
    script = "\n".join(blocks).replace("http://127.0.0.1:8000", serve_app.base_url)
    assert script.count("export BASE=smollm2") == 1 and "demo" not in script
    script = script.replace("export BASE=smollm2", "export BASE=demo")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "push support" in done.stderr and "100%" in done.stderr  # the progress bar
    completion = next(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"id":"cmpl-'))
    assert completion["model"] == "demo:support" and completion["usage"]["completion_tokens"] >= 1

    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(f"{serve_app.base_url}/admin/v1/adapters/support", headers=auth).status_code == 404  # deleted
    audit = httpx.get(f"{serve_app.base_url}/admin/v1/audit", headers=auth, params={"name": "support"}).json()
    assert [(e["action"], e["version"]) for e in audit][:10] == [
        ("delete_adapter", None), ("delete_version", 2), ("enable", None), ("disable", None),
        ("rollback", None), ("promote", 2), ("canary", 2), ("register", 2), ("promote", 1), ("register", 1)]
    # the automatic rollout: golden prompts set, a refused policy, two steps, then the promotion, in the audit log
    faq = httpx.get(f"{serve_app.base_url}/admin/v1/audit", headers=auth, params={"name": "faq"}).json()
    assert [e["action"] for e in faq][:6] == ["rollout_promote", "rollout_step", "rollout_step", "rollout_start",
                                             "rollout_start_rejected", "set_golden"]
    assert faq[0]["details"]["result"]["canary"]["requests"] >= 5 and faq[0]["after"]["active_version"] == 2
    assert "rollout_promote" not in [e["action"] for e in faq[1:]]
    uploads = Path(serve_app.registry.settings.upload_dir)
    assert audit[9]["details"]["source_uri"].startswith(str(uploads))  # v1: the CLI upload
    assert audit[7]["details"]["source_uri"] == str(uploads / "support-v2-upload")  # v2: the raw HTTP upload
