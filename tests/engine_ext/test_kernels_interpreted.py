"""The Triton kernels' logic on the CPU through Triton's interpreter (interpreted_checks.py, one subprocess a
check: TRITON_INTERPRET must be set before the kernels are defined). Skipped where Triton is not installed;
the GPU tests (gpu/) check the compiled kernels, in bf16 too."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("check", ["attention", "fused", "ranks", "lora", "engine", "fp8", "growth", "metadata",
                                   "commit"])
def test_kernel_logic_under_the_interpreter(check):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "interpreted_checks.py"), check], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"ok {check}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
