"""Triton kernels (imported as ``kvreuse.kernels``): each kernel has a PyTorch reference beside it and one public
launcher. On a machine without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``) for tests."""

import torch

# The KV cache and key dtypes every kernel, and the module store that feeds them, accept.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
