"""Warm starts of LLM replicas: a new replica's worker process is a fork of a server that already imported what
a replica imports before it serves (Ray's worker and Serve's replica, torch, transformers, this project).

A replacement replica spends most of its start-up in a new Python process importing those: about 6 s of CPU on
an idle CPU machine, three times that on a busy one. Ray keeps no spare worker process to start it in (the
workers it prestarts go to the first actors of a session), and a module Ray preloads into a new worker is
imported by that same new process, so neither saves anything. Hence one server per node and Ray session: the
first LLM replica ready on a node starts it (`ensure_server`, detached so that it outlives that replica); it
imports `PRELOAD_MODULES`, listens on `warm_launch.socket_path(raylet pid)`, and exits with the raylet. Every
LLM replica's worker starts through `warm_launch.py` (the replicas' runtime_env `py_executable`), which asks the
server for a fork and otherwise starts the worker as Ray would.

The server forks only for a worker it can stand in for: the same interpreter and environment it imported under
(Ray's core library reads its RAY_* settings, the job and the raylet's pid, when it loads; other libraries read
theirs at import), Ray's own worker script, and the project's imported sources unchanged on disk (a server that
finds them changed refuses and exits; the next replica that gets ready starts a fresh one). Anything else gets
"cold" and starts as before.
"""

from __future__ import annotations

import array
import gc
import importlib
import json
import logging
import os
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from deployments.serve_internals import SERVE_REPLICA_MODULE, ray_worker_script
from deployments.warm_launch import HEADER_BYTES, socket_path
from engine_ext.core import CORE_MODULE, CoreLaunch

__all__ = ["PRELOAD_MODULES", "MODULE_PROGRAMS", "launcher_command", "core_launch", "ensure_server",
           "server_answers", "forked_at"]

logger = logging.getLogger(__name__)

# What an LLM replica imports before it serves: Serve's replica actor (Ray's worker with it), the engine and
# torch, the tokenizer's transformers classes, the deployment and what its constructor imports; and its engine
# core's process.
PRELOAD_MODULES = (SERVE_REPLICA_MODULE, "torch", "transformers",
                   "transformers.tokenization_utils_tokenizers", "safetensors.torch", "engine_ext",
                   "deployments.replica.llm_deployment", "deployments.bootstrap", "registry", "demo", CORE_MODULE)
# Programs a launcher may ask for besides Ray's worker script, as `-m MODULE`: an LLM replica's engine core
# process, so a replacement's core starts without a new interpreter's imports either.
MODULE_PROGRAMS = (CORE_MODULE,)
# BLAS and OpenMP pools start their threads when their library loads; the server must hold no thread when it
# forks, and a forked replica sets its torch threads itself (torch.set_num_threads).
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
# Left out of the environment a worker must share with the server: the server sets these for itself, and a
# forked worker takes its launcher's values (an engine core: the GPUs Ray gave its replica; the server never
# touches CUDA, so the fork reads them when it first does).
PER_WORKER_ENV = frozenset(SINGLE_THREADED) | {"CUDA_VISIBLE_DEVICES"}
ACCEPT_TIMEOUT_S = 0.5  # how often the server reaps forked workers and checks the raylet

_forked_at: Optional[float] = None  # set in a forked worker: when the server forked it


def forked_at() -> Optional[float]:
    """When this process was forked from the warm server (wall clock), or None: it started cold."""
    return _forked_at


def _launcher() -> tuple[str, ...]:
    return sys.executable, "-I", "-S", str(Path(__file__).with_name("warm_launch.py"))


def launcher_command() -> str:
    """The LLM replicas' runtime_env `py_executable`: this interpreter running warm_launch.py."""
    return " ".join(shlex.quote(part) for part in _launcher())


def core_launch() -> Optional[CoreLaunch]:
    """How an LLM replica starts its engine core: through warm_launch.py, as a fork of this node's warm server,
    when one answers (None: a new interpreter). Call inside the replica. The core's environment is the one the
    replica started with (what the server imported under), with this replica's per-worker values."""
    if not server_answers():
        return None
    env = {k: v for k, v in _launch_environ().items() if k not in PER_WORKER_ENV}
    env |= {k: os.environ[k] for k in PER_WORKER_ENV if k in os.environ}
    return CoreLaunch(command=_launcher(), env=env)


# ---------------------------------------------------------------------------------------------- replica side
def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def server_answers() -> bool:
    """Whether this node's warm server is up (call inside a Ray worker of the node)."""
    raylet_pid = os.environ.get("RAY_RAYLET_PID")
    return bool(raylet_pid) and _answers(socket_path(raylet_pid))


def _launch_environ() -> dict[str, str]:
    """This process's environment as it started: what Ray gives each worker it starts on this node (Ray adds
    more in-process: PYTHONBREAKPOINT, OMP_NUM_THREADS, the accelerators an actor got, ...)."""
    try:
        raw = Path("/proc/self/environ").read_bytes().decode(errors="surrogateescape")
    except OSError:
        return dict(os.environ)
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def ensure_server() -> None:
    """Start this node's warm server unless one answers. Call inside an LLM replica: the server imports under
    that replica's interpreter and environment, the ones the replicas Ray starts next on this node get."""
    raylet_pid = os.environ.get("RAY_RAYLET_PID")
    if not raylet_pid or server_answers():
        return
    # "spawn" starts the server in a session of its own and returns at once, so the server is no child of
    # this replica (Ray ends a worker's children and process group with it).
    command = [sys.executable, "-m", "deployments.warm_start", "spawn", socket_path(raylet_pid)]
    try:
        subprocess.run(command, env={**_launch_environ(), **SINGLE_THREADED}, stdin=subprocess.DEVNULL, timeout=60,
                       check=True)
    except (OSError, subprocess.SubprocessError):  # replicas then start cold, as without warm starts
        logger.warning("cannot start the warm start server", exc_info=True)


# ----------------------------------------------------------------------------------------------- server side
def _project_sources() -> dict[str, int]:
    """file -> mtime of every imported module that is not part of the standard library or an installed
    package: the sources a redeploy can change under a running server."""
    paths = sysconfig.get_paths()
    libraries = tuple(os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    out = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and not os.path.realpath(file).startswith(libraries):
            try:
                out[file] = os.stat(file).st_mtime_ns
            except OSError:
                pass
    return out


def _cuda_driver_loaded() -> bool:
    """Whether something initialised CUDA here (the driver library loads then, not when torch is imported)."""
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        torch = sys.modules.get("torch")
        return torch is not None and torch.cuda.is_initialized()


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


class _Imported:
    """What the server imported under, and whether a worker request matches it."""

    def __init__(self, worker_script: str) -> None:
        self.python = os.path.realpath(sys.executable)
        self.env = {k: v for k, v in os.environ.items() if k not in PER_WORKER_ENV}
        self.worker_script = os.path.realpath(worker_script)
        self.sources = _project_sources()

    def refusal(self, request: dict) -> Optional[str]:
        """Why the worker `request` describes cannot be a fork of this server, or None."""
        argv, env = request["argv"], request["env"]
        if os.path.realpath(request["python"]) != self.python:
            return "interpreter"
        if not argv or (argv[0] != "-m" and os.path.realpath(argv[0]) != self.worker_script):
            return "worker-script"
        if argv[0] == "-m" and argv[1:2] not in [[m] for m in MODULE_PROGRAMS]:
            return "program"
        differ = sorted(k for k in set(env) ^ set(self.env) | {k for k in env if env[k] != self.env.get(k)}
                        if k not in PER_WORKER_ENV)
        if differ:
            return "env:" + ",".join(differ)
        if self.stale():
            return "sources-changed"
        return None

    def stale(self) -> bool:
        for file, mtime in self.sources.items():
            try:
                if os.stat(file).st_mtime_ns != mtime:
                    return True
            except OSError:
                return True
        return False


def _receive(conn: socket.socket, fds: list[int]) -> Optional[dict]:
    """A launcher's request, its file descriptors appended to `fds`; None from a connection that only checked
    that the server is up."""
    data, ancillary, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(4 * array.array("i").itemsize))
    received = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
    fds.extend(received)
    if not data:
        return None
    while True:
        size = int.from_bytes(data[:HEADER_BYTES], "big")
        if len(data) >= HEADER_BYTES and len(data) - HEADER_BYTES >= size:
            return json.loads(data[HEADER_BYTES:HEADER_BYTES + size])
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk


def _exit_with_launcher(alive_fd: int) -> None:
    while os.read(alive_fd, 1):
        pass
    os._exit(1)


def _become_worker(request: dict, fds: list[int], inherited: list) -> None:
    """In the forked child: take the launcher's stdio, directory, environment and command line, and run Ray's
    worker script (or a module of MODULE_PROGRAMS) as `python ARGV` would. Never returns."""
    global _forked_at
    code = 1
    try:
        _forked_at = time.time()
        os.setsid()  # a process group of its own: Ray ends a worker's group with it, not the server's
        for server_file in inherited:  # the server's socket, lock and other launchers' connections
            server_file.close()
        for target, fd in zip((0, 1, 2), fds[:3]):
            os.dup2(fd, target)
        for fd in fds[:3]:
            if fd > 2:
                os.close(fd)
        threading.Thread(target=_exit_with_launcher, args=(fds[3],), daemon=True).start()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = list(request["argv"])
        if sys.argv[0] == "-m":
            sys.argv, module = [sys.argv[1], *sys.argv[2:]], sys.argv[1]
            sys.path[0] = request["cwd"]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
            runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then the worker's exit code
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream at exit
                pass
        os._exit(code)


def _reap(waiting: dict[int, socket.socket]) -> None:
    """Tell each launcher whose worker ended how it ended."""
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


def _alive(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def serve(path: str, modules: tuple[str, ...] = PRELOAD_MODULES, worker_script: Optional[str] = None) -> None:
    """Import `modules`, then fork a `worker_script` (default: Ray's) for each launcher that asks and matches,
    until the raylet that started this node's workers exits (or the imported sources change)."""
    import fcntl

    import psutil  # a Ray dependency

    raylet = psutil.Process(int(os.environ["RAY_RAYLET_PID"]))
    # Held for the server's life: one server per socket. Socket and lock are this user's alone.
    lock = os.fdopen(os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o600), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return
    started = time.perf_counter()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this installation lacks: its workers import it themselves
            logger.warning("warm start server: cannot preload %s", name, exc_info=True)
    if _native_threads() > 1 or _cuda_driver_loaded():  # neither survives a fork: the forks would break
        logger.warning("warm start server: not forking (%d threads, CUDA driver loaded: %s after the imports)",
                       _native_threads(), _cuda_driver_loaded())
        return
    imported = _Imported(worker_script or ray_worker_script())
    gc.freeze()  # the imported objects stay out of the forks' collections: their pages stay shared
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX)
    umask = os.umask(0o177)
    try:
        server.bind(path)
    finally:
        os.umask(umask)
    server.listen(64)
    server.settimeout(ACCEPT_TIMEOUT_S)
    print(f"warm start server {os.getpid()} on {path}: imported in {time.perf_counter() - started:.1f} s",
          file=sys.stderr, flush=True)
    waiting: dict[int, socket.socket] = {}
    try:
        while _alive(raylet):
            try:
                conn, _ = server.accept()
            except socket.timeout:
                conn = None
            if conn is not None and not _fork_for(conn, imported, [server, lock], waiting):
                break
            _reap(waiting)
    finally:
        server.close()
        for file in (path, path + ".lock"):
            if os.path.exists(file):
                os.unlink(file)


def _fork_for(conn: socket.socket, imported: _Imported, server_files: list,
              waiting: dict[int, socket.socket]) -> bool:
    """Answer one launcher: fork its worker, or tell it to start cold. False: this server should stop."""
    conn.settimeout(5.0)
    fds: list[int] = []
    try:
        request = _receive(conn, fds)
        if request is None:
            conn.close()
            return True
        reason = "fds" if len(fds) != 4 else imported.refusal(request)
        if reason is not None:
            print(f"warm start server: cold start ({reason})", file=sys.stderr, flush=True)
            conn.sendall(f"cold {reason.replace(' ', '_')}\n".encode())
            conn.close()
            return reason != "sources-changed"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_worker(request, fds, [*server_files, conn, *waiting.values()])
        conn.sendall(f"pid {pid}\n".encode())
        conn.settimeout(None)
        waiting[pid] = conn
    except (OSError, ValueError) as e:  # a launcher that went away, or a malformed request
        print(f"warm start server: request failed: {e!r}", file=sys.stderr, flush=True)
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)
    return True


def _spawn(path: str) -> None:
    subprocess.Popen([sys.executable, "-m", "deployments.warm_start", "serve", path], start_new_session=True,
                     stdin=subprocess.DEVNULL, close_fds=True)


if __name__ == "__main__":
    # Runs the functions of the imported module (not of this __main__ copy), so a forked worker's
    # `forked_at()` reads the module its replica imports.
    from deployments import warm_start

    command, socket_file = sys.argv[1:3]
    {"spawn": warm_start._spawn, "serve": warm_start.serve}[command](socket_file)
