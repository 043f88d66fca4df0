"""GPU tests (`@pytest.mark.gpu`); each module skips itself where Triton or a CUDA device is missing."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tiny_models, char_tokenizer
