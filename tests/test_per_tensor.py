"""``PerTensor``: a value made once per tensor object, and gone with the tensor."""

from __future__ import annotations

import gc

import torch

from kvreuse.sparse.per_tensor import PerTensor


def test_a_value_is_made_once_per_tensor_and_dropped_with_it():
    made: list[int] = []

    def make(tensor: torch.Tensor) -> int:
        made.append(tensor.numel())
        return tensor.numel()

    memo = PerTensor(make)
    a, b = torch.zeros(3), torch.zeros(5)
    assert (memo(a), memo(a), memo(b), memo(a)) == (3, 3, 5, 3)
    assert made == [3, 5]
    del a
    gc.collect()
    assert len(memo._entries) == 1  # a's entry went with a
    c = torch.zeros(7)  # may take a's id: its own value all the same
    assert memo(c) == 7 and made == [3, 5, 7]


def test_a_view_of_the_same_storage_is_another_tensor():
    memo = PerTensor(lambda tensor: tensor.stride())
    base = torch.zeros(4, 6)
    assert memo(base) == (6, 1) and memo(base.t()) == (1, 6)
