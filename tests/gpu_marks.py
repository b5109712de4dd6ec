"""Skip marks of the GPU tests (`pytest -m gpu`), by how many CUDA GPUs this machine has.

The fp32-without-TF32 fixture they use is `exact_fp32` in conftest.py.
"""

from __future__ import annotations

import pytest
import torch

one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
