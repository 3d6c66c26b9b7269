"""The README documents every setting with its variable and default."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.config import describe
from kvreuse.modules.config import ModulesConfig
from kvreuse.reorder.config import ReorderConfig
from kvreuse.sglang.settings import SGLangConfig
from kvreuse.sparse.config import SparseConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize(
    ("config", "plugin"),
    [(ReorderConfig, "reorder"), (SparseConfig, "sparse"), (ModulesConfig, "modules"), (SGLangConfig, "sglang")],
)
def test_every_setting_is_in_the_readme_table_with_its_default(config, plugin):
    for key, variable, default, _ in describe(config, plugin):
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert f"| `{key}` | `{variable}` | {shown} |" in README, key
