"""Warm starts (deployments/warm_start.py, deployments/warm_launch.py) without Ray: a launcher run the way Ray
runs a replica's `py_executable` gets its worker forked from the server when the server can stand in for it
(the worker sees the server's imports and the launcher's stdio, directory, arguments and per-worker
environment), and otherwise runs the worker itself; launcher and worker end together; the server ends with
its raylet. A sleeping process plays the raylet."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployments.warm_launch import socket_path

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = REPO / "deployments" / "warm_launch.py"

WORKER = """
import json, os, sys, time
report = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
          "preloaded": "warm_marker" in sys.modules, "threads": os.environ.get("OMP_NUM_THREADS")}
print(json.dumps(report), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def node(tmp_path):
    """A fake node: a 'raylet' process, a scratch dir (TMPDIR and PYTHONPATH) with the worker script and a module
    the server preloads, and the environment Ray would give a worker there."""
    raylet = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "warm_marker.py").write_text("LOADED = True\n")
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), "RAY_RAYLET_PID": str(raylet.pid),
           "RAY_JOB_ID": "01000000", "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    yield {"dir": tmp_path, "raylet": raylet, "env": env, "socket": socket_path(str(raylet.pid), str(tmp_path))}
    raylet.kill()
    raylet.wait()


def start_server(node) -> subprocess.Popen:
    code = (f"from deployments.warm_start import serve; serve({node['socket']!r}, modules=('warm_marker',), "
            f"worker_script={str(node['dir'] / 'worker.py')!r})")
    server = subprocess.Popen([sys.executable, "-c", code], env={**node["env"], "OMP_NUM_THREADS": "1"},
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(node["socket"]):
        assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
        time.sleep(0.05)
    return server


def launch(node, *args, env=None, worker=None, wait=True):
    """Run the launcher as Ray runs a worker's py_executable (`python -I -S warm_launch.py SCRIPT ARGS`)."""
    cmd = [sys.executable, "-I", "-S", str(LAUNCHER), str(worker or node["dir"] / "worker.py"), *args]
    env = {**node["env"], "OMP_NUM_THREADS": "3", **(env or {})}
    proc = subprocess.Popen(cmd, env=env, cwd=node["dir"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=60)
    return proc.returncode, json.loads(out.splitlines()[0]), err


def stop(server):
    server.kill()
    server.wait()


def test_the_worker_is_forked_from_the_server_with_the_launchers_stdio_dir_args_and_exit_code(node):
    server = start_server(node)
    try:
        code, report, _ = launch(node, "exit", "7")
        assert code == 7
        assert report["preloaded"] and report["ppid"] == server.pid  # a fork: the server's imports, not its own
        assert report["argv"] == [str(node["dir"] / "worker.py"), "exit", "7"]
        assert report["cwd"] == str(node["dir"]) and report["threads"] == "3"  # the launcher's per-worker env
    finally:
        stop(server)


def test_without_a_server_the_launcher_becomes_the_worker(node):
    proc = launch(node, "exit", "0", wait=False)
    out, _ = proc.communicate(timeout=60)
    report = json.loads(out.splitlines()[0])
    assert proc.returncode == 0 and report["pid"] == proc.pid and not report["preloaded"]


@pytest.mark.parametrize("change", ["job", "worker script"])
def test_a_worker_the_server_cannot_stand_in_for_starts_cold(node, change):
    server = start_server(node)
    try:
        other = node["dir"] / "other_worker.py"
        other.write_text(WORKER)
        code, report, _ = launch(node, "exit", "0", env={"RAY_JOB_ID": "02000000"} if change == "job" else None,
                                 worker=other if change == "worker script" else None)
        assert code == 0 and not report["preloaded"]
        assert launch(node, "exit", "0")[1]["preloaded"]  # the server still forks for a matching worker
    finally:
        stop(server)


def test_changed_sources_start_cold_and_stop_the_server(node):
    server = start_server(node)
    try:
        marker = node["dir"] / "warm_marker.py"
        os.utime(marker, ns=(time.time_ns(), time.time_ns() + 10**9))
        assert not launch(node, "exit", "0")[1]["preloaded"]
        server.wait(timeout=30)
        assert not os.path.exists(node["socket"])
    finally:
        stop(server)


def test_launcher_and_forked_worker_end_together(node):
    server = start_server(node)
    try:
        # Ray ends a worker (SIGTERM to the process it started): the worker gets it, the launcher ends as it did
        proc = launch(node, "sleep", "0", wait=False)
        worker = json.loads(proc.stdout.readline())["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
        assert_gone(worker)
        # the launcher killed outright: its worker exits too
        proc = launch(node, "sleep", "0", wait=False)
        worker = json.loads(proc.stdout.readline())["pid"]
        proc.kill()
        proc.wait(timeout=30)
        assert_gone(worker)
    finally:
        stop(server)


def test_only_the_servers_user_can_reach_it(node):
    server = start_server(node)
    try:
        assert os.stat(node["socket"]).st_mode & 0o777 == 0o600
    finally:
        stop(server)


def test_the_server_ends_with_its_raylet(node):
    server = start_server(node)
    try:
        node["raylet"].kill()
        node["raylet"].wait()
        server.wait(timeout=30)
        assert not os.path.exists(node["socket"])
    finally:
        stop(server)


def assert_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still runs")


def test_an_engine_core_is_forked_from_the_server_and_fails_fast_when_killed(node, demo_paths):
    """An LLM replica's engine core asked of the launcher (`-m engine_ext.core.process`, the replica's launch
    environment) is a fork of the server, which imported it already; it serves, and a SIGKILL of it reaches its
    client within 2 s (the server reaps it, the launcher exits as it did)."""
    import asyncio

    import psutil

    from engine_ext import AsyncLLMEngine, EngineConfig, EngineDeadError, SamplingParams
    from engine_ext.core import CORE_MODULE, CoreLaunch

    code = (f"from deployments.warm_start import serve; serve({node['socket']!r}, "
            f"modules=('warm_marker', {CORE_MODULE!r}), worker_script={str(node['dir'] / 'worker.py')!r})")
    server = subprocess.Popen([sys.executable, "-c", code], env={**node["env"], "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not os.path.exists(node["socket"]):
        assert server.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    launch = CoreLaunch(command=(sys.executable, "-I", "-S", str(LAUNCHER)),
                        env={**node["env"], "OMP_NUM_THREADS": "2"})
    engine = AsyncLLMEngine(EngineConfig(model=demo_paths["model"], num_kv_blocks=64, engine_process=True),
                            launch=launch)

    async def generate(n):
        return [o async for o in engine.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
            max_tokens=n, ignore_eos=True))]

    try:
        assert psutil.Process(engine.core_pid).ppid() == server.pid  # forked, not a new interpreter
        assert asyncio.run(generate(4))[-1].finished
        killed = time.monotonic()
        os.kill(engine.core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(generate(10_000), timeout=30))
        assert time.monotonic() - killed < 2.0 and not engine.is_alive()
    finally:
        engine.shutdown()
        stop(server)
