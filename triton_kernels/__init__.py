"""Triton kernels (imported as ``kvreuse.kernels``): each kernel has a PyTorch reference beside it and one public
launcher. On a machine without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``) for tests."""
