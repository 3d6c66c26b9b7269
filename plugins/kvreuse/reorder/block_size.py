"""Whether the engine's KV block size lets the prompts it serves share anything.

An engine's prefix cache (vLLM's, SGLang's with pages) shares whole blocks only: a request takes from it the full
blocks of its prompt that an earlier request computed, never a partial one, and never the prompt's last token. So a
prompt shorter than one block takes nothing from the cache, and prompts share cached KV only where their common
start is at least one block. vLLM's CPU platform defaults to 128-token blocks, longer than a table row's prompt (a
chat preamble, an instruction and a few fields: often 60-150 tokens), so with that default a table job shares
nothing; 32-token blocks let rows share their common start (vLLM's GPU default is 16).

Two checks, each a warning the engine adapter logs once:

* :func:`block_size_warning`, at start: the block size is larger than :data:`ROW_BLOCK_SIZE` and the user did not
  choose it (the platform's default);
* :class:`ShortPromptWatch`, after the first :data:`SAMPLE` admissions: at least half of them were shorter than one
  block, so they could take nothing from the prefix cache (whoever chose the block size).

Engine-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

# The block size the docs use for table jobs: a row's prompt of 60-150 tokens then has 1-4 full blocks to share.
ROW_BLOCK_SIZE = 32
# Admitted prompts looked at before judging whether the block size suits them.
SAMPLE = 32

FIX = "set a smaller block size (vllm serve --block-size 32; block_size=32 in Python)"


def block_size_warning(block_size: int, chosen_by_user: bool) -> str | None:
    """The start-up warning for an engine whose ``block_size`` the user did not choose and which is larger than
    :data:`ROW_BLOCK_SIZE` (None otherwise)."""
    if chosen_by_user or block_size <= ROW_BLOCK_SIZE:
        return None
    return (
        f"kvreuse: KV blocks of {block_size} tokens (the platform's default): the prefix cache shares whole blocks "
        f"only, so requests share cached KV only where their common start is at least {block_size} tokens, and a "
        f"prompt shorter than that takes nothing from it; for table rows and other short prompts {FIX}"
    )


class ShortPromptWatch:
    """Watches the lengths of the first :data:`SAMPLE` admitted prompts; :meth:`observe` returns a warning once if
    at least half of them were shorter than one block."""

    def __init__(self, block_size: int, sample: int = SAMPLE) -> None:
        self.block_size = block_size
        self.sample = sample
        self.lengths: list[int] = []

    @property
    def done(self) -> bool:
        return len(self.lengths) >= self.sample

    def observe(self, prompt_lengths: Iterable[int]) -> str | None:
        """Record admitted prompts' lengths; the warning when this completes the sample and it calls for one."""
        if self.done:
            return None
        self.lengths.extend(prompt_lengths)
        if not self.done:
            return None
        self.lengths = self.lengths[: self.sample]
        short = sum(length < self.block_size for length in self.lengths)
        if 2 * short < len(self.lengths):
            return None
        return (
            f"kvreuse: {short} of the first {len(self.lengths)} prompts were shorter than one KV block of "
            f"{self.block_size} tokens (median {statistics.median(self.lengths):g} tokens), so they could take "
            f"nothing from the prefix cache; {FIX}"
        )
