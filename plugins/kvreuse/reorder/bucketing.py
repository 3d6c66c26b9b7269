"""Dynamic prefix bucketing: reorder an unbounded stream of requests in bounded memory.

A whole-table solver needs every row up front; a stream (rows arriving from a scan, requests from clients) does
not wait. Following Daft's prefix bucketing, requests are held in a buffer of bounded size; when it fills, it is
sorted by prompt key and cut into buckets of requests that share a long prefix, and the largest buckets are
released, each as one batch of neighbours. Small buckets stay behind to meet later arrivals with their prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from kvreuse.errors import ConfigError, TableError

T = TypeVar("T")
Key = str | tuple[int, ...]
_Entry = tuple[Key, int, T]  # (sort key, arrival number, item): equal keys keep arrival order


def bucket_stream(
    items: Iterable[T],
    key: Callable[[T], str | Sequence[int]],
    *,
    buffer_size: int = 4096,
    min_bucket: int = 8,
    split_fraction: float = 0.5,
) -> Iterator[list[T]]:
    """Yield ``items`` in buckets of shared prefixes, holding at most ``buffer_size`` items at a time.

    ``key(item)`` is the item's prompt (a string, or token ids); all keys must be of one kind. When the buffer
    holds ``buffer_size`` items it is sorted by key and cut between neighbours whose common prefix is shorter
    than ``split_fraction`` of the shorter key. Every bucket of at least ``min_bucket`` items is released,
    largest first; if that frees less than half the buffer, the largest remaining buckets follow until half is
    free, so each item takes part in ``O(1)`` sorts on average. At the end of the stream every remaining bucket
    is released, largest first. Every item is yielded exactly once, within a bucket in key order.
    """
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ConfigError(f"buffer_size must be a positive integer, got {buffer_size!r}")
    if isinstance(min_bucket, bool) or not isinstance(min_bucket, int) or not 1 <= min_bucket <= buffer_size:
        raise ConfigError(f"min_bucket must be an integer in [1, buffer_size={buffer_size}], got {min_bucket!r}")
    if (
        isinstance(split_fraction, bool)
        or not isinstance(split_fraction, (int, float))
        or not 0.0 <= split_fraction <= 1.0
    ):
        raise ConfigError(f"split_fraction must be a number in [0, 1], got {split_fraction!r}")
    buffer: list[_Entry[T]] = []
    kind = None
    for arrival, item in enumerate(items):
        raw = key(item)
        sort_key = raw if isinstance(raw, str) else tuple(raw)
        kind = kind or type(sort_key)
        if type(sort_key) is not kind:
            raise TableError(
                f"item {arrival} has a {type(raw).__name__} key but earlier items have "
                f"{kind.__name__} keys; keys must all be strings or all token-id sequences"
            )
        buffer.append((sort_key, arrival, item))
        if len(buffer) == buffer_size:
            released, buffer = _release(buffer, split_fraction, min_bucket, buffer_size // 2 + buffer_size % 2)
            yield from released
    if buffer:
        released, _ = _release(buffer, split_fraction, 1, len(buffer))
        yield from released


def _release(
    buffer: list[_Entry[T]], split_fraction: float, min_bucket: int, min_freed: int
) -> tuple[list[list[T]], list[_Entry[T]]]:
    """Buckets to yield (items, largest first) and the entries kept, releasing at least ``min_freed`` items."""
    buffer.sort(key=lambda entry: entry[:2])
    buckets = _cut(buffer, split_fraction)
    by_size = sorted(range(len(buckets)), key=lambda b: -len(buckets[b]))
    released: set[int] = set()
    freed = 0
    for b in by_size:
        if len(buckets[b]) < min_bucket and freed >= min_freed:
            break
        released.add(b)
        freed += len(buckets[b])
    kept = [entry for b, bucket in enumerate(buckets) if b not in released for entry in bucket]
    return [[item for *_, item in buckets[b]] for b in by_size if b in released], kept


def _cut(entries: list[_Entry[T]], split_fraction: float) -> list[list[_Entry[T]]]:
    """Split sorted entries between neighbours whose common prefix is short relative to the shorter key."""
    buckets = [[entries[0]]]
    for previous, entry in zip(entries, entries[1:]):
        a, b = previous[0], entry[0]
        if common_prefix_length(a, b) < split_fraction * min(len(a), len(b)):
            buckets.append([])
        buckets[-1].append(entry)
    return buckets


def common_prefix_length(a: Key, b: Key) -> int:
    """Length of the longest common prefix of two strings or two tuples, by binary search on slices."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
