"""Prefix bucketing of a stream: bounded memory, every item once, shared prefixes released together."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import bucket_stream
from kvreuse.reorder.bucketing import common_prefix_length


class CountingStream:
    """Yields items and remembers how many have been taken, to measure what the bucketer holds."""

    def __init__(self, items):
        self.items, self.taken = list(items), 0

    def __iter__(self):
        for item in self.items:
            self.taken += 1
            yield item


def drain(stream: CountingStream, **kwargs) -> tuple[list[list[str]], int]:
    """The buckets, and the most items the bucketer held (taken but not yet yielded) at any yield."""
    buckets, released, most_held = [], 0, 0
    for bucket in bucket_stream(stream, key=lambda item: item, **kwargs):
        most_held = max(most_held, stream.taken - released)
        released += len(bucket)
        buckets.append(bucket)
    return buckets, most_held


@settings(max_examples=150, deadline=None)
@given(
    items=st.lists(st.text(alphabet="abc", max_size=6), max_size=80),
    buffer_size=st.integers(1, 12),
    min_bucket=st.integers(1, 12),
    split_fraction=st.floats(0.0, 1.0),
)
def test_every_item_is_yielded_once_and_the_buffer_never_exceeds_its_size(
    items, buffer_size, min_bucket, split_fraction
):
    min_bucket = min(min_bucket, buffer_size)
    tagged = [f"{text}#{i}" for i, text in enumerate(items)]
    buckets, most_held = drain(
        CountingStream(tagged), buffer_size=buffer_size, min_bucket=min_bucket, split_fraction=split_fraction
    )
    assert sorted(item for bucket in buckets for item in bucket) == sorted(tagged)
    assert all(buckets)
    assert most_held <= buffer_size


def test_interleaved_prefix_families_come_out_in_their_own_buckets():
    families = ["SELECT * FROM orders WHERE ", "SELECT * FROM users WHERE ", "Summarize the review: "]
    items = [f"{families[i % 3]}{i}" for i in range(30)]
    # The two SELECTs share 14 characters of about 28: a split_fraction above one half tells them apart.
    buckets, _ = drain(CountingStream(items), buffer_size=30, min_bucket=2, split_fraction=0.75)
    assert len(buckets) == 3
    for bucket in buckets:
        assert len({next(f for f in families if item.startswith(f)) for item in bucket}) == 1


def test_small_buckets_wait_in_the_buffer_for_later_items_with_their_prefix():
    items = ["alpha 1", "alpha 2", "alpha 3", "beta 1", "alpha 4", "alpha 5", "alpha 6", "beta 2"]
    buckets, _ = drain(CountingStream(items), buffer_size=4, min_bucket=2, split_fraction=0.5)
    # At the first fill, alpha's bucket of 3 goes and beta 1 stays; it meets beta 2 at the end.
    assert ["beta 1", "beta 2"] in buckets


def test_largest_buckets_are_released_first():
    items = ["b1", "a1", "b2", "b3", "a2", "c1"]
    buckets, _ = drain(CountingStream(items), buffer_size=6, min_bucket=1, split_fraction=0.5)
    assert buckets == [["b1", "b2", "b3"], ["a1", "a2"], ["c1"]]


def test_token_id_keys_bucket_like_strings():
    items = [(7, 7, 1), (9, 9, 9), (7, 7, 2), (9, 9, 8)]
    buckets = list(bucket_stream(items, key=lambda ids: list(ids), buffer_size=8, min_bucket=1))
    assert buckets == [[(7, 7, 1), (7, 7, 2)], [(9, 9, 8), (9, 9, 9)]]


def test_mixing_string_and_token_keys_is_an_error():
    with pytest.raises(TableError, match="item 1 has a list key but earlier items have str keys"):
        list(bucket_stream(["ab", [1, 2]], key=lambda item: item))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"buffer_size": 0}, "buffer_size must be a positive integer, got 0"),
        ({"buffer_size": 4, "min_bucket": 5}, r"min_bucket must be an integer in \[1, buffer_size=4\], got 5"),
        ({"split_fraction": 1.5}, r"split_fraction must be a number in \[0, 1\], got 1.5"),
    ],
)
def test_bad_parameters_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        list(bucket_stream(["a"], key=lambda item: item, **kwargs))


def test_common_prefix_length_of_strings_and_token_ids():
    assert common_prefix_length("prefix-a", "prefix-b") == 7
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length((1, 2, 3), (1, 2, 3)) == 3
