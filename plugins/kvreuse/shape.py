"""Bounds on the shape of the free-form values a request or a configuration carries (JSON objects and lists).

A request's ``kv_transfer_params``, ``vllm_xargs`` and ``ec_transfer_params`` reach vLLM's engine core as
``SamplingParams.extra_args``, which vLLM pickles to send each request to its engine process: an object nested
600 deep (about 3 KB of JSON) makes that pickling fail with ``RecursionError`` and ends the engine, every
tenant's requests with it (stock vLLM 0.32 too). So every such value is bounded where it is parsed, before vLLM
sees the request, in three ways, each with a limit derived from what legitimate values need and what breaks:

* nesting depth, :data:`MAX_DEPTH` = 32 levels (the top-level mapping is level 1). kvreuse's own parameters need 3
  (``extra_args`` > ``kv_transfer_params`` > ``kvreuse_ape`` > a number), vLLM's disaggregated-prefill connectors
  4 (block ids per KV-cache group, lists in a list); pickling fails at some 600 levels, Python's recursion limit of
  1,000 less the frames below it, so 32 leaves room for any connector's metadata and a margin of more than 10x;
* elements, :data:`MAX_ELEMENTS` = 2^20 (1,048,576): objects, lists, keys and scalars, counted over the whole
  value. The largest legitimate value is a connector's list of one block id per KV block of the prompt: a
  1,048,576-token context in blocks of 16 is 65,536 ids per KV-cache group, so 2^20 holds 16 groups of it;
* text, :data:`MAX_TEXT` = 2^20 characters: the sum of the lengths of every key and string. kvreuse's longest
  text is a module name of 128 characters; connectors send host names and ids. A megabyte of metadata per request
  is far more than any needs and keeps the copy and the pickle of a request small.

The walk is iterative (a value nested past Python's recursion limit is measured too) and stops at the first limit
crossed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MAX_DEPTH = 32
MAX_ELEMENTS = 1 << 20
MAX_TEXT = 1 << 20


@dataclass(frozen=True)
class ShapeLimits:
    """The limits a value is held to (defaults: the module's)."""

    depth: int = MAX_DEPTH
    elements: int = MAX_ELEMENTS
    text: int = MAX_TEXT


def shape_problem(value: object, where: str, limits: ShapeLimits = ShapeLimits()) -> tuple[str, str] | None:
    """``(field, message)`` naming the first limit ``value`` crosses (the field: ``where`` and the keys down to
    the first object or list too deep, or ``where`` for a count over the whole value), or ``None``.

    Objects are mappings; lists are lists, tuples and sets; anything else is one scalar (strings count their
    length as text).
    """
    elements = text = 0
    stack: list[tuple[object, int, str]] = [(value, 1, where)]
    while stack:
        item, depth, field = stack.pop()
        elements += 1
        if isinstance(item, str):
            text += len(item)
        elif isinstance(item, Mapping | list | tuple | set | frozenset):
            if depth > limits.depth:
                return field, (
                    f"{field} is nested more than {limits.depth} levels deep; kvreuse accepts at most {limits.depth} "
                    "(its own parameters need 3)"
                )
            if isinstance(item, Mapping):
                for key, inner in item.items():
                    elements += 1
                    text += len(key) if isinstance(key, str) else 0
                    stack.append((inner, depth + 1, f"{field}.{str(key)[:32]}" if depth < 4 else field))
            else:
                stack.extend((inner, depth + 1, field) for inner in item)
        if elements > limits.elements:
            return where, (
                f"{where} holds more than {limits.elements:,} values (objects, lists, keys and scalars); kvreuse "
                f"accepts at most {limits.elements:,}"
            )
        if text > limits.text:
            return where, (
                f"{where} holds more than {limits.text:,} characters of keys and strings; kvreuse accepts at most "
                f"{limits.text:,}"
            )
    return None
