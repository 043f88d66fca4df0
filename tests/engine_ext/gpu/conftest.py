"""GPU-only tests (`@pytest.mark.gpu`): the Triton kernels against their references, adapter loads on a side
stream, traffic at real model shapes; each module skips itself where Triton or a CUDA device is missing. Suites
that hold on every backend sit one level up and ask for the `backend` fixture (backends.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tiny_models, char_tokenizer, backends
