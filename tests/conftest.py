"""Shared test set-up: without a CUDA GPU, Triton kernels run in Triton's interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module imports
``kvreuse.kernels``. vLLM's CPU build disables Triton itself, so engine tests are unaffected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
