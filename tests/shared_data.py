"""The shared datasets some tests read: ``../shared/datasets`` beside the repository, or the folder that
``KVREUSE_DATASETS`` names (``kvreuse.localmodel.DATASETS``).

A test that needs one fails, naming the file and where it was looked for, when it is missing: a skipped test is not
a passed one, and a checkout without the datasets must not look green.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.localmodel import DATASETS


def dataset(relative: str) -> Path:
    """The path of ``relative`` in the shared datasets folder; fails the calling test if it is not there."""
    path = DATASETS / relative
    if not path.exists():
        pytest.fail(
            f"{path} is missing: this test reads the shared datasets folder (../shared/datasets beside the "
            "repository, or the folder KVREUSE_DATASETS names)",
            pytrace=False,
        )
    return path
