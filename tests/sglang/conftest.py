"""Set-up of the SGLang adapter tests (run them with ``make test-sglang``, in ``.venv-sglang``).

They test kvreuse's SGLang adapters against SGLang's real classes (``Req``, ``RadixCache``, ``SchedulePolicy``,
``HookRegistry``, the attention and radix-cache registries, ``ForwardBatch``, the KV pools) on CPU tensors;
SGLang's engine itself needs a GPU. Two test-environment shims come first: stand-in ``torchvision`` modules
(``sglang_stubs``, see there why), and Triton's interpreter for kernels on CPU tensors (``TRITON_INTERPRET`` is read
when a kernel is decorated, so it is set before anything imports ``kvreuse.kernels``).
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_stubs  # noqa: E402

sglang_stubs.install()
