"""What the README's quick start claims, measured: `serve run deployments.app` started as a user starts it, the
time until its first chat reply, the replies of the base model and each adapter (greedy, the `openai` client),
and the memory the app holds then (the proportional set size of `serve run` and every process under it, so
pages shared by forked workers count once).

    python bench/first_reply.py [--timeout 120]     # port 8000 must be free

Prints one JSON object; stops the app with SIGINT (Ctrl-C) at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What is the capital of France?"


def pss_mib(pid: int) -> dict[str, float]:
    """Proportional set size of `pid` and all its descendants by process title (Ray names its workers), MiB."""
    import psutil

    by_name: dict[str, float] = {}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(p.cmdline()[:1]).split("/")[-1][:40] or p.name()
            by_name[name] = by_name.get(name, 0.0) + p.memory_full_info().pss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    from openai import OpenAI

    repo = Path(__file__).resolve().parents[1]
    serve = Path(sys.executable).parent / "serve"
    log = tempfile.NamedTemporaryFile("w", prefix="first_reply-", suffix=".log", delete=False)
    t0 = time.monotonic()
    proc = subprocess.Popen([str(serve), "run", "deployments.app"], cwd=repo,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-loraserve-dev", max_retries=0,
                    timeout=60)
    result: dict = {"bench": "first_reply", "command": "serve run deployments.app"}
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve run exited {proc.returncode}; see {log.name}")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"no reply within {args.timeout} s; see {log.name}")
            try:
                first = client.chat.completions.create(model="smollm2", max_tokens=args.max_tokens, temperature=0,
                                                       messages=[{"role": "user", "content": QUESTION}])
                break
            except Exception:   # not up yet: connection refused, 404 or 503 while the app deploys
                time.sleep(0.5)
        result["first_reply_s"] = round(time.monotonic() - t0, 1)
        result["first_reply"] = first.choices[0].message.content
        replies = {}
        for model in ["smollm2", "smollm2:shout", "smollm2:json", "smollm2:terse", "smollm2:docstring"]:
            content = QUESTION if model != "smollm2:docstring" else (
                "Write a one-line docstring for this function:\n\n```python\ndef add(a, b):\n    return a + b\n```")
            t = time.monotonic()
            r = client.chat.completions.create(model=model, max_tokens=args.max_tokens, temperature=0,
                                               messages=[{"role": "user", "content": content}])
            replies[model] = {"reply": r.choices[0].message.content, "seconds": round(time.monotonic() - t, 2),
                              "completion_tokens": r.usage.completion_tokens}
        result["replies"] = replies
        by_process = pss_mib(proc.pid)
        result["memory_pss_mib"] = round(sum(by_process.values()))
        result["memory_by_process_mib"] = {name: round(v) for name, v in by_process.items()}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
