"""A table's prompts as the engine's tokens, tokenized once per distinct cell, and the block hits of any order.

In the ``lines`` format a prompt is the instruction's head (``instruction + "\\n\\n"``) followed by one
``"field: value\\n"`` line per field. Tokenizers of the byte-level BPE and SentencePiece kinds split text at line
breaks, so the prompt's tokens are the head's tokens followed by each line's tokens: a table needs one
tokenization per distinct (field, value), not one per prompt per candidate order. :func:`tokenize_lines`
tokenizes each line after a line break (as it always follows one) and checks the assumption on a sample of whole
prompts; where it fails (a tokenizer that merges across line breaks) it returns ``None`` and callers tokenize
whole prompts instead.

:func:`order_block_hits` then scores an order as vLLM's prefix cache would reuse it, from the cached tokens
alone: a prompt hits the full blocks of its common token prefix with the prompt sent before it (leading lines
equal, then the common tokens of the first lines that differ: two lines of one field share ``"field: "`` and
any common start of their values), but never its last token, which is recomputed for its logits. That is vLLM's
hit exactly when only the previous prompt's blocks are cached, and a lower bound with a larger cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from kvreuse.errors import TableError
from kvreuse.reorder.measures import BlockHitStats, block_hit_stats
from kvreuse.reorder.ordering import Ordering, prompts
from kvreuse.reorder.stats import EncodedTable, encode_table
from kvreuse.reorder.table import render_prompt

# Tokens of a line's start compared for a partial match; lines sharing more than this are rare and score this.
PARTIAL_TOKENS = 48
# Whole prompts tokenized to check that line tokens add up to prompt tokens.
CHECKED_PROMPTS = 16


@dataclass(frozen=True)
class LineTokens:
    """The token form of an encoded table's prompts: the head's tokens, and per column and code its line's.

    ``lengths[c][code]`` is the number of tokens of column ``c``'s line for that value; ``starts`` holds every
    line's first ``PARTIAL_TOKENS`` tokens (padded with -1), indexed by the line's global key: the column's
    offset plus the code, offsets in ``offsets``.
    """

    head_tokens: int
    lengths: tuple[np.ndarray, ...]
    offsets: np.ndarray
    starts: np.ndarray
    key_lengths: np.ndarray

    def cell_tokens(self, codes: np.ndarray) -> np.ndarray:
        """``(n_rows, n_cols)`` token counts of every cell's line."""
        out = np.empty(codes.shape, dtype=np.int64)
        for c, lengths in enumerate(self.lengths):
            out[:, c] = lengths[codes[:, c]]
        return out


def tokenize_lines(
    table: pd.DataFrame,
    encoded: EncodedTable,
    instruction: str,
    tokenize: Callable[[list[str]], Sequence[Sequence[int]]],
) -> LineTokens | None:
    """Tokenize ``instruction``'s head and each distinct line of a prepared ``table`` once (``lines`` format).

    ``None`` if whole prompts do not tokenize as their head and lines do (checked on up to ``CHECKED_PROMPTS``
    rows, each with its fields in the table's order and reversed).
    """
    names = [str(c) for c in table.columns]
    head = f"{instruction}\n\n"
    cells = table.to_numpy(dtype=object)
    uniques = []  # uniques[c][code]: the value, read at the first row holding that code
    for c in range(len(names)):
        _, first_rows = np.unique(encoded.codes[:, c], return_index=True)
        uniques.append(cells[first_rows, c])
    texts = [f"{names[c]}: {value}\n" for c in range(len(names)) for value in uniques[c].tolist()]
    if not texts:
        return None
    # A line is tokenized between the line break before it and a field name after it, as in a prompt: a value's
    # trailing spaces tokenize differently before a letter and at the end of a text.
    before_piece, after_piece = tokenize(["\n", "\nfield"])
    before = list(before_piece)
    after = list(after_piece)[len(before) :]
    pieces = tokenize([head + texts[0] + "field", *("\n" + text + "field" for text in texts)])
    line_ids = []
    for piece in pieces[1:]:
        ids = list(piece)
        if ids[: len(before)] != before or ids[len(ids) - len(after) :] != after:
            return None
        line_ids.append(ids[len(before) : len(ids) - len(after)])
    # The head is tokenized before a line, as in a prompt: alone, its closing blank line may tokenize otherwise.
    first = list(pieces[0])[: len(pieces[0]) - len(after)]
    if first[len(first) - len(line_ids[0]) :] != line_ids[0]:
        return None
    head_ids = first[: len(first) - len(line_ids[0])]
    counts = np.array([len(u) for u in uniques], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    key_lengths = np.fromiter((len(ids) for ids in line_ids), dtype=np.int64, count=len(line_ids))
    starts = np.full((len(line_ids), PARTIAL_TOKENS), -1, dtype=np.int64)
    for k, ids in enumerate(line_ids):
        head_part = list(ids[:PARTIAL_TOKENS])
        starts[k, : len(head_part)] = head_part
    lengths = tuple(key_lengths[offsets[c] : offsets[c] + counts[c]] for c in range(len(names)))
    tokens = LineTokens(len(head_ids), lengths, offsets, starts, key_lengths)
    if not _adds_up(table, encoded, instruction, tokenize, head_ids, line_ids, offsets):
        return None
    return tokens


def _adds_up(
    table: pd.DataFrame,
    encoded: EncodedTable,
    instruction: str,
    tokenize: Callable[[list[str]], Sequence[Sequence[int]]],
    head_ids: list[int],
    line_ids: list[list[int]],
    offsets: np.ndarray,
) -> bool:
    """Whether sampled whole prompts tokenize as the head's tokens followed by their lines' tokens.

    The last line is left out of the comparison: it ends the text, where trailing spaces of its value may
    tokenize otherwise; that changes the prompt's length by a token at most, and never a shared prefix (the
    last token is never a hit).
    """
    names = [str(c) for c in table.columns]
    cells = table.to_numpy(dtype=object)
    sample = np.linspace(0, encoded.n_rows - 1, min(CHECKED_PROMPTS, encoded.n_rows)).astype(np.int64).tolist()
    orders = [list(range(encoded.n_cols)), list(range(encoded.n_cols))[::-1]]
    texts: list[str] = []
    expected: list[list[int]] = []
    for row in sample:
        for order in orders:
            texts.append(render_prompt(instruction, [names[c] for c in order], [cells[row, c] for c in order]))
            ids = list(head_ids)
            for c in order[:-1]:
                ids += list(line_ids[offsets[c] + encoded.codes[row, c]])
            expected.append(ids)
    return all(list(ids[: len(start)]) == start for ids, start in zip(tokenize(texts), expected))


def order_block_hits(encoded: EncodedTable, tokens: LineTokens, ordering: Ordering, block_size: int) -> BlockHitStats:
    """The token counts of sending ``ordering`` to a block cache that keeps the previous prompt (module doc)."""
    n = len(ordering.rows)
    if n == 0:
        return BlockHitStats(0, 0, 0)
    rows = np.asarray(ordering.rows, dtype=np.int64)
    fields = np.array(ordering.fields, dtype=np.int64)
    keys = encoded.codes[rows[:, None], fields] + tokens.offsets[fields]
    lengths = tokens.key_lengths[keys]
    prompt_lengths = tokens.head_tokens + lengths.sum(axis=1)
    total = int(prompt_lengths.sum())
    if n == 1:
        return BlockHitStats(total, 0, total)
    equal = keys[1:] == keys[:-1]
    leading = np.cumprod(equal, axis=1, dtype=np.int64)
    shared = tokens.head_tokens + (leading * lengths[1:]).sum(axis=1)
    first_diff = leading.sum(axis=1)
    open_ = first_diff < keys.shape[1]
    if open_.any():
        at = np.flatnonzero(open_)
        column = first_diff[at]
        a, b = keys[at, column], keys[at + 1, column]
        same = tokens.starts[a] == tokens.starts[b]
        partial = np.cumprod(same, axis=1).sum(axis=1)
        shared[at] += np.minimum(partial, np.minimum(tokens.key_lengths[a], tokens.key_lengths[b]))
    usable = np.minimum(shared, prompt_lengths[1:] - 1) // block_size * block_size
    hits = int(usable.sum())
    return BlockHitStats(total, hits, total - hits)


class TokenHitMeasure:
    """Scores orders of one prepared table by the token hit rate the engine would see: its tokenizer, its block size.

    In the ``lines`` format, when line tokens add up to prompt tokens (:func:`tokenize_lines`), the table is
    tokenized once, here, and each score is :func:`order_block_hits` from the cached tokens; ``line_tokens``
    then lets GGR weigh each cell by its line's tokens. Otherwise each score tokenizes the order's prompts and
    replays them through :func:`kvreuse.reorder.block_hit_stats` (an unbounded cache).
    """

    def __init__(
        self,
        table: pd.DataFrame,
        instruction: str,
        fmt: str,
        tokenize: Callable[[list[str]], Sequence[Sequence[int]]],
        block_size: int,
    ) -> None:
        self.table, self.instruction, self.fmt = table, instruction, fmt
        self.tokenize, self.block_size = tokenize, block_size
        self.encoded = encode_table(table)
        self.line_tokens = tokenize_lines(table, self.encoded, instruction, tokenize) if fmt == "lines" else None

    def check_table(self, encoded: EncodedTable) -> None:
        """Raise :class:`~kvreuse.errors.TableError` unless ``encoded`` is the table this measure was built for."""
        mine = self.encoded
        if mine.names != encoded.names or not np.array_equal(mine.codes, encoded.codes):
            raise TableError(
                f"the token measure was built for another table ({mine.n_rows} rows, fields "
                f"{', '.join(mine.names)}), not this one ({encoded.n_rows} rows, fields {', '.join(encoded.names)}); "
                "build it for this table: token_hit_measure(table, ...)"
            )

    def stats(self, ordering: Ordering) -> BlockHitStats:
        """Prompt, hit and computed tokens of sending ``ordering`` (an ordering of this measure's table)."""
        ordering.validate(self.encoded.n_rows, self.encoded.n_cols)
        if self.line_tokens is not None:
            return order_block_hits(self.encoded, self.line_tokens, ordering, self.block_size)
        return block_hit_stats(
            self.tokenize(prompts(ordering, self.table, self.instruction, self.fmt)), self.block_size
        )

    def __call__(self, ordering: Ordering) -> float:
        return self.stats(ordering).hit_rate


def token_hit_measure(
    table: pd.DataFrame,
    instruction: str,
    fmt: str,
    tokenize: Callable[[list[str]], Sequence[Sequence[int]]],
    block_size: int,
) -> TokenHitMeasure:
    """Score orders of a prepared ``table`` as the engine would hit them; pass it to ``solve(..., measure=...)``.

    ``tokenize`` maps prompts to token ids as the engine does (with special tokens).
    """
    return TokenHitMeasure(table, instruction, fmt, tokenize, block_size)


def sorted_neighbour_order(encoded: EncodedTable, tokens: LineTokens) -> tuple[int, ...]:
    """Columns by how many tokens neighbouring rows share in them when rows are sorted on that column alone.

    A field whose sorted values share long starts (numbers with common leading digits, names with a common
    first word) lets neighbours share tokens past the cells they share whole, which characters of whole cells
    (the statistics order) do not see; ties keep the statistics order.
    """
    from kvreuse.reorder.stats import fixed_field_order

    stats_rank = {c: i for i, c in enumerate(fixed_field_order(encoded.stats()))}
    shared = []
    for c in range(encoded.n_cols):
        whole, partial, _ = _sorted_neighbour_tokens(encoded, tokens, c)
        shared.append((whole + partial) / max(encoded.n_rows - 1, 1))
    return tuple(sorted(range(encoded.n_cols), key=lambda c: (-shared[c], stats_rank[c])))


def shared_start_order(encoded: EncodedTable, tokens: LineTokens, field_order: Sequence[int]) -> tuple[int, ...]:
    """Columns by how many leading tokens a line shares with the nearest other value of its field (sorted).

    Fields that lead a group together are shared whole by all its rows whatever their order; what their order
    changes is the group's first prompt, which can share only the start of the first line with an earlier
    prompt (another group's line of the same field: ``"field: "`` and any common start of the values). So the
    field whose distinct values share the longest starts leads (a link column of common ``m/`` paths before a
    free-text one). Ties keep ``field_order``.
    """
    rank = {c: i for i, c in enumerate(field_order)}
    start = []
    for c in range(encoded.n_cols):
        _, partial, distinct = _sorted_neighbour_tokens(encoded, tokens, c)
        start.append(partial / max(distinct - 1, 1))
    return tuple(sorted(range(encoded.n_cols), key=lambda c: (-start[c], rank[c])))


def _sorted_neighbour_tokens(encoded: EncodedTable, tokens: LineTokens, c: int) -> tuple[int, int, int]:
    """(whole, partial, distinct) for column ``c`` with rows sorted on it: tokens neighbours share in equal lines,
    tokens neighbouring distinct values share at their start, and the number of distinct values."""
    # Sorted on c, neighbours share a whole line where their values are equal, and the common start of two
    # neighbouring values where they differ (codes number values in sorted order).
    count = np.bincount(encoded.codes[:, c], minlength=len(encoded.lengths[c]))
    keys = np.flatnonzero(count) + tokens.offsets[c]
    whole = int(((count[count > 0] - 1) * tokens.key_lengths[keys]).sum())
    a, b = keys[:-1], keys[1:]
    same = tokens.starts[a] == tokens.starts[b]
    partial = int(np.minimum(np.cumprod(same, axis=1).sum(axis=1), tokens.key_lengths[a]).sum())
    return whole, partial, len(keys)
