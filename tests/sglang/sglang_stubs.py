"""Test-environment shim: stand-in ``torchvision`` modules, so SGLang's modules import on a CPU machine.

SGLang imports ``torchvision`` unconditionally in a few multimodal modules. Its wheel depends on a CUDA build of
torchvision, which the SGLang test environment (``.venv-sglang``: torch 2.13.0+cpu, sglang installed with
``--no-deps``) does not have, and the CPU torchvision wheel for this torch breaks ``transformers``. Nothing the
adapters use touches torchvision; this shim only lets the imports succeed. It is not part of kvreuse: a real SGLang
installation has torchvision.

``transformers`` is asked first whether torchvision is available, so it caches ``False`` and never treats the
stand-ins as the real thing.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
    "torchvision.io",
    "torchvision.ops",
)


class _Anything:
    """Any attribute, call or base class: what a module-level ``from torchvision... import X`` needs."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def install() -> None:
    """Put the stand-ins in ``sys.modules`` (once; a real torchvision, if importable, is left alone)."""
    if "torchvision" in sys.modules:
        return
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return
    for name in _MODULES:
        module = _StubModule(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        sys.modules[name] = module
