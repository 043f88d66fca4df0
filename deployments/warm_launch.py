"""The LLM replicas' worker launcher: Ray runs it, as the replicas' `py_executable`, with the worker's command
line (`default_worker.py ARGS`). When this node's warm server (deployments/warm_start.py) runs and accepts,
the worker is a fork of that server, which already imported Ray, Serve's replica, torch, transformers and this
project; otherwise the launcher becomes the worker exactly as Ray would start it (`exec python ARGS`).

    python -I -S warm_launch.py default_worker.py ARGS...

A forked worker and its launcher live and die together, so Ray's view of the process it started stays true:
the launcher waits for the worker's exit status and exits with it, forwards the signals Ray sends, and the
worker exits when the launcher is gone (a pipe whose write end only the launcher holds).

Standard library only and no package import: it runs on every replica start, before anything is imported.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys
import tempfile
import time

__all__ = ["socket_path", "HEADER_BYTES"]

HEADER_BYTES = 4  # big-endian length of the JSON request that follows
REPLY_TIMEOUT_S = 10.0


def socket_path(raylet_pid: str, directory: str | None = None) -> str:
    """The warm server's socket for the raylet with this pid (one server per node and Ray session), in
    `directory` (default: the temp dir, TMPDIR)."""
    return os.path.join(directory or tempfile.gettempdir(), f"loraserve-warm-{raylet_pid}.sock")


def _cold(args: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *args])


def _forked(args: list[str]):
    """(the server's replies, pid) of a worker the warm server forked with `args`, or None when it did not."""
    raylet_pid = os.environ.get("RAY_RAYLET_PID")
    if not raylet_pid:
        return None
    conn = socket.socket(socket.AF_UNIX)
    try:
        conn.connect(socket_path(raylet_pid))
    except OSError:
        conn.close()
        return None
    alive_r, alive_w = os.pipe()  # the worker sees EOF on alive_r once this process is gone
    request = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "python": sys.executable})
    message = len(request.encode()).to_bytes(HEADER_BYTES, "big") + request.encode()
    sent = conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2, alive_r]))])
    conn.sendall(message[sent:])
    os.close(alive_r)
    conn.settimeout(REPLY_TIMEOUT_S)  # past it, start cold: a worker forked late exits with this process's exec
    replies = conn.makefile("r")
    try:
        reply = replies.readline().split()
    except OSError:
        reply = []
    if len(reply) != 2 or reply[0] != "pid":  # "cold REASON": this request does not match what it imported
        replies.close()
        conn.close()
        os.close(alive_w)
        return None
    conn.settimeout(None)
    return replies, int(reply[1])


def _wait(replies, pid: int) -> int:
    """The forked worker's exit code (negative: killed by that signal), forwarding Ray's signals to it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda n, _frame: os.kill(pid, n))
    reply = replies.readline().split()
    if len(reply) == 2 and reply[0] == "exit":
        return int(reply[1])
    while True:  # the server went away first: wait for the worker itself
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 1
        time.sleep(0.5)


def main(args: list[str]) -> None:
    try:
        forked = _forked(args)
    except Exception as e:  # noqa: BLE001 - any failure to get a fork: start the way Ray would have
        print(f"warm_launch: starting cold ({e!r})", file=sys.stderr, flush=True)
        forked = None
    if forked is None:
        _cold(args)
    code = _wait(*forked)
    if code < 0:  # end the way the worker ended
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
