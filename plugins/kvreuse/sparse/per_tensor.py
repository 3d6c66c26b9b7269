"""Values made once per tensor object, for work a hot path would otherwise redo on every call with the same tensor.

A layer's caches and key sketch are the same tensor objects for the engine's life, and what is derived from them
(a flat numpy view of their storage, a view with another shape) depends only on the tensor's storage and strides,
which a tensor never changes. ``PerTensor`` keys each value by the tensor's identity and holds the tensor weakly:
its entry goes when the tensor does, and an id reused by a later tensor is told apart by the weak reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class PerTensor(Generic[T]):
    """``make(tensor)``, made on the first call with each tensor and returned again for it after."""

    def __init__(self, make: Callable[[torch.Tensor], T]) -> None:
        self._make = make
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], T]] = {}

    def __call__(self, tensor: torch.Tensor) -> T:
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not tensor:
            entries = self._entries
            entry = entries[key] = (weakref.ref(tensor, lambda _: entries.pop(key, None)), self._make(tensor))
        return entry[1]
