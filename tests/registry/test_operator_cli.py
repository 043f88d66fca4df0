"""The `lora-registry` CLI: direct mode (settings from env) in-process and as the installed console script, and
REST mode against the control plane served by uvicorn on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from registry.cli import main
from tests.fixtures.services import free_port
from tests.registry.adapter_kit import BASE, TEST_LIMITS


@pytest.fixture
def cli_env(monkeypatch, tmp_path, incoming_root):
    env = {"REGISTRY_DB": str(tmp_path / "r.db"), "BLOB_DIR": str(tmp_path / "blobs"),
           "MATERIALIZE_DIR": str(tmp_path / "mat"), "ALLOWED_LOCAL_ROOTS": f"{incoming_root},/nonexistent",
           **{k.upper(): str(v) for k, v in TEST_LIMITS.items()}}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("S3_BUCKET", raising=False)
    monkeypatch.delenv("LORA_REGISTRY_URL", raising=False)
    return env


def run(capsys, *argv) -> tuple[int, object, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_direct_mode_push_and_lifecycle(cli_env, capsys, adapter_templates, tiny_base):
    assert run(capsys, "base-model", BASE, str(tiny_base))[0] == 0
    code, rec, err = run(capsys, "--actor", "bob", "push", str(adapter_templates["a"]), "--name", "ops",
                         "--base-model", BASE, "--label", "team=search")
    assert code == 0, err
    assert rec["status"] == "ready" and rec["labels"] == {"team": "search"}
    assert "push ops" in err and "B" in err  # tqdm progress bar on stderr
    assert run(capsys, "push", str(adapter_templates["b"]), "--name", "ops", "--base-model", BASE,
               "--activate")[1]["status"] == "active"
    assert run(capsys, "canary", "ops", "1", "0.25")[1]["canary_version"] == 1
    assert run(capsys, "promote", "ops", "1")[1]["active_version"] == 1
    assert run(capsys, "rollback", "ops")[1]["active_version"] == 2
    assert run(capsys, "disable", "ops")[1]["disabled"] is True
    assert run(capsys, "enable", "ops")[1]["disabled"] is False
    assert run(capsys, "retire", "ops", "1")[1]["versions"]["1"]["status"] == "retired"
    assert [a["name"] for a in run(capsys, "list")[1]["items"]] == ["ops"]
    assert run(capsys, "show", "ops")[1]["active_version"] == 2
    audit = run(capsys, "audit", "--name", "ops", "--order", "oldest")[1]
    assert [e["action"] for e in audit][-6:] == ["canary", "promote", "rollback", "disable", "enable", "retire"]
    assert audit[0]["actor"] == "bob"
    assert run(capsys, "audit", "--name", "ops", "--limit", "1")[1][0]["action"] == "retire"  # newest first


def test_direct_mode_refusal_exits_nonzero_with_reason(cli_env, capsys, adapter_templates, tiny_base, tmp_path):
    assert run(capsys, "base-model", BASE, str(tiny_base))[0] == 0
    bad = tmp_path / "bad"
    shutil.copytree(adapter_templates["r16"], bad)
    code, _, err = run(capsys, "push", str(bad), "--name", "big", "--base-model", BASE)
    assert code == 1 and "rank 16 is too high" in err
    code, _, err = run(capsys, "promote", "big", "1")
    assert code == 1 and "not found" in err  # the refusal recorded no adapter


def test_console_script_is_installed(cli_env, adapter_templates, tiny_base):
    exe = shutil.which("lora-registry", path=os.path.dirname(os.sys.executable))
    assert exe, "console script lora-registry not installed in the venv"
    env = {**os.environ, **cli_env}
    subprocess.run([exe, "base-model", BASE, str(tiny_base)], env=env, check=True, capture_output=True)
    out = subprocess.run([exe, "push", str(adapter_templates["a"]), "--name", "cs", "--base-model", BASE],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "ready"


@pytest.fixture
def served(make_registry):
    """The control plane over real HTTP: uvicorn in a thread on a free port."""
    import uvicorn

    from registry.api import create_app

    reg = make_registry("sqlite+local")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(reg, {"tok": {"role": "admin", "name": "cli-admin"}}),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", reg
    server.should_exit = True
    thread.join(timeout=10)


def test_rest_mode_against_uvicorn(served, cli_env, capsys, adapter_templates):
    url, reg = served
    code, rec, err = run(capsys, "--url", url, "--token", "tok", "push", str(adapter_templates["a"]), "--name", "r",
                         "--base-model", BASE, "--activate")
    assert code == 0, err
    assert rec["status"] == "active" and reg.resolve("r", None).version == 1
    assert run(capsys, "--url", url, "--token", "tok", "disable", "r")[1]["disabled"] is True
    assert [e["actor"] for e in run(capsys, "--url", url, "--token", "tok", "audit", "--name", "r")[1]] == \
        ["cli-admin"] * 3
    code, _, err = run(capsys, "--url", url, "--token", "nope", "list")
    assert code == 1 and "HTTP 401" in err


def test_base_model_upload_in_direct_mode_only(cli_env, capsys, tiny_base, monkeypatch):
    from registry import Registry, RegistrySettings

    code, spec, err = run(capsys, "base-model", "stored-base", str(tiny_base), "--upload")
    assert code == 0, err
    assert "model.safetensors" in spec["files"] and spec["blob_location"]
    reg = Registry.from_settings(RegistrySettings())
    try:
        assert (reg.materialize_base("stored-base") / "config.json").read_bytes() == \
            (tiny_base / "config.json").read_bytes()
    finally:
        reg.close()
    monkeypatch.setattr("registry.cli.HttpBackend._control_plane_root", staticmethod(lambda url: url))
    code, _, err = run(capsys, "--url", "http://127.0.0.1:9", "base-model", "x", str(tiny_base), "--upload")
    assert code == 1 and "without --url" in err


def test_help_names_every_command_and_says_what_each_does():
    from registry.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert "register base models." in text  # the whole description, not its first line cut off
    (sub,) = [a for a in parser._actions if a.dest == "command"]  # noqa: SLF001 - argparse keeps them there
    helps = {c.dest: c.help for c in sub._choices_actions}  # noqa: SLF001
    assert set(helps) == set(sub.choices) and len(helps) == 16 and all(helps.values()), helps
    for name in sub.choices:
        assert name in text


def test_init_example_writes_an_adapter_the_registry_accepts(cli_env, capsys, tiny_base, tmp_path):
    assert run(capsys, "base-model", BASE, str(tiny_base))[0] == 0
    code, out, err = run(capsys, "init-example", str(tmp_path / "ex"), "--base-model", BASE, "--rank", "4")
    assert code == 0, err
    assert sorted(out["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    code, rec, err = run(capsys, "push", str(tmp_path / "ex"), "--name", "ex", "--base-model", BASE, "--activate")
    assert code == 0, err
    assert rec["rank"] == 4 and sorted(rec["target_modules"]) == ["q_proj", "v_proj"] and rec["status"] == "active"
    code, _, err = run(capsys, "init-example", str(tmp_path / "ex"), "--base-model", BASE)
    assert code == 1 and "not empty" in err


def test_a_reader_that_goes_away_ends_the_cli_quietly(cli_env, capsys, tiny_base):
    """`lora-registry list | head -1`: the reader closes the pipe before the CLI writes; no traceback."""
    import sys
    from pathlib import Path

    assert run(capsys, "base-model", BASE, str(tiny_base))[0] == 0
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "registry.cli", "list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(repo)})
    proc.stdout.close()  # head has read its line and exited
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err
    shell = subprocess.run(f"{sys.executable} -m registry.cli audit --limit 1000 | head -c 1", shell=True,
                           capture_output=True, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=60)
    assert shell.stdout == b"[" and b"Traceback" not in shell.stderr and b"BrokenPipe" not in shell.stderr


def test_uploads_reports_the_upload_area(cli_env, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("UPLOAD_DIR", str(tmp_path / "uploads"))
    monkeypatch.setenv("MAX_UPLOAD_AREA_BYTES", "4096")
    session = tmp_path / "uploads" / "half-done-01"
    session.mkdir(parents=True)
    (session / "adapter_config.json").write_text("{}")
    code, usage, err = run(capsys, "uploads")
    assert code == 0, err
    assert usage["bytes"] == 2 and usage["max_bytes"] == 4096 and usage["ttl_s"] == 86400
    assert [(s["upload_id"], s["files"]) for s in usage["sessions"]] == [("half-done-01", 1)]


def test_canary_start_thresholds_take_numbers_and_true_or_false():
    """`--threshold` values reach the rollout policy typed: numbers as numbers, true/false as booleans (the policy's
    StrictBool refuses a string); anything else is refused before any request."""
    from registry.cli import CliError, _canary, build_parser

    class Backend:  # the control plane faked: the policy the CLI would send
        def rollout(self, name, verb, body=None):
            return {"name": name, "verb": verb, "body": body}

    args = build_parser().parse_args(["canary", "start", "faq", "2", "--threshold", "require_draft_acceptance=true",
                                      "--threshold", "ttft_p99_ratio=3", "--threshold", "latency_slack_s=0.5"])
    sent = _canary(args, Backend())
    assert sent["body"]["policy"]["thresholds"] == {"require_draft_acceptance": True, "ttft_p99_ratio": 3,
                                                    "latency_slack_s": 0.5}
    from registry.canary_policy import RolloutPolicy

    assert RolloutPolicy.model_validate(sent["body"]["policy"]).thresholds.require_draft_acceptance is True
    with pytest.raises(CliError):
        _canary(build_parser().parse_args(["canary", "start", "faq", "2", "--threshold", "ttft_p99_ratio=yes"]),
                Backend())
