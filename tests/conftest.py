"""Shared test set-up: without a CUDA GPU, Triton kernels run in Triton's interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module imports
``kvreuse.kernels``. vLLM's CPU build disables Triton itself, so engine tests are unaffected.
"""

import os

import pytest
import torch

# tests/sglang runs in its own environment (`make test-sglang`): SGLang is not installed next to vLLM.
collect_ignore = ["sglang"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def local_tokenizer():
    """The local test model's byte-level BPE tokenizer (``tokenizers.Tokenizer``), building the model if needed.

    Built rather than skipped: on a fresh clone nothing else has built it before the unit tests run.
    """
    from pathlib import Path

    from tokenizers import Tokenizer

    from kvreuse.localmodel import build_model

    model = build_model("small", Path(__file__).resolve().parents[1] / "build" / "models" / "small")
    return Tokenizer.from_file(str(model / "tokenizer.json"))
