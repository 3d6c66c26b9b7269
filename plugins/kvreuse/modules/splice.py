"""Which prompt tokens an engine can take from cached modules instead of computing them, and where they go.

An engine that caches prefixes (vLLM, SGLang) computes a request from its first uncached token to its end, so
KV can only be supplied for one run of tokens that starts where the engine's own prefix hit ends. Given the
modules found in the prompt (``ModuleTrie.find``: sorted, never overlapping), :func:`plan_splice` takes the
module covering that first uncached token (from the right offset when the hit ends inside it) and then every
module that starts exactly where the previous one ends, while the store holds them. Free text between two
modules ends the run: the tokens after it are computed, even where they are a module. So prompts gain most when
their modules come first and their free text (the question) last, or when recurring free text (an
instruction) is itself registered as a module.

Each :class:`Piece` moves a module's keys from the positions it was encoded at to the prompt positions it takes:
``delta = prompt_start - (module_start + offset)``, one rotation for the whole piece (``kvreuse.kernels.rerotate``).

A module found in a prompt but not spliced is reported, with the reason (:func:`skipped_modules`,
:class:`SkipReason`), so an operator can tell a layout that defeats the cache from a store that is too small;
so is a module the prompt holds all but the last token of (``ModuleTrie.near_misses``): the text after it merged
with its last token, so its tokens differ from the module's and it cannot be found at all.

An engine's prefix cache must never give a block that holds spliced KV to a request that did not ask for exactly
that module entry: :func:`block_modules` gives, per cache block, the modules whose tokens lie in it, so an adapter
can fold their entries' keys into the block's hash (the blocks after them chain from that hash).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from kvreuse.kernels.rerotate import RopeSpec, move_keys
from kvreuse.modules.store import EncodedModule
from kvreuse.modules.trie import ModuleMatch


@dataclass(frozen=True)
class Piece:
    """Prompt tokens ``[prompt_start, prompt_start + length)`` are module ``name``'s tokens from ``offset`` on."""

    name: Hashable
    offset: int
    prompt_start: int
    length: int

    @property
    def prompt_end(self) -> int:
        return self.prompt_start + self.length

    @property
    def module_start(self) -> int:
        """The prompt position where the piece's module starts (before ``prompt_start`` where the piece starts
        inside its module: an engine's prefix hit ended there)."""
        return self.prompt_start - self.offset

    def delta(self, module_start: int) -> int:
        """Positions to move the piece's keys by, for a module encoded at ``module_start``."""
        return self.prompt_start - (module_start + self.offset)


def plan_splice(
    matches: Sequence[ModuleMatch], start: int, stop: int, available: Callable[[Hashable], bool]
) -> list[Piece]:
    """The pieces covering prompt tokens ``[start, end)`` for the largest ``end <= stop`` the modules reach.

    ``matches`` are sorted and disjoint; ``available(name)`` says whether the store holds a module now. The run
    ends at the first gap (free text), at the first module the store lacks, or at ``stop`` (an engine must
    compute at least a prompt's last token, so callers pass ``len(prompt) - 1``).
    """
    pieces: list[Piece] = []
    pos = start
    for match in matches:
        if match.end <= pos:
            continue
        if match.start > pos or pos >= stop or not available(match.name):
            break
        end = min(match.end, stop)
        pieces.append(Piece(match.name, pos - match.start, pos, end - pos))
        pos = end
    return pieces


def run_from(run: Sequence[Piece], position: int, stop: int | None = None) -> list[Piece]:
    """The part of a spliced ``run`` (:func:`plan_splice`'s pieces) at prompt positions ``position`` to ``stop``
    (default: its end): what is left to load when an engine's prefix hit holds the tokens before ``position``
    (nothing where it holds the whole run), or what an engine's blocks up to ``stop`` can take now."""
    pieces = []
    for piece in run:
        end = piece.prompt_end if stop is None else min(piece.prompt_end, stop)
        begin = max(position, piece.prompt_start)
        if end <= begin:
            continue
        skip = begin - piece.prompt_start
        pieces.append(Piece(piece.name, piece.offset + skip, begin, end - begin))
    return pieces


def first_tokens(pieces: Sequence[Piece], k: int | Mapping[int, int]) -> tuple[int, ...]:
    """Prompt positions of the pieces' tokens that are among the first ``k`` tokens of their module, ascending: the
    tokens LegoLink recomputes (Hu et al. 2024, "EPIC: Efficient Position-Independent Context Caching", section 4).

    A module's first tokens carry the attention sink that encoding it alone put there; recomputed with the whole
    prompt before them, they attend across modules again. A piece that starts inside its module (the engine's
    prefix hit ended there) recomputes only those of its tokens that are still among the module's first ``k``.
    ``k`` may differ per module: a mapping from the prompt position where a module starts (``Piece.module_start``)
    to its count, as :func:`allot_first_tokens` gives it (a module missing from it recomputes none).
    """
    counts = [k if isinstance(k, int) else k.get(piece.module_start, 0) for piece in pieces]
    return tuple(
        piece.prompt_start + i
        for piece, count in zip(pieces, counts)
        for i in range(max(0, min(piece.length, count - piece.offset)))
    )


def allot_first_tokens(run: Sequence[Piece], k: int, exact: Callable[[Piece], bool]) -> dict[int, int]:
    """How many of its first tokens each module of a spliced ``run`` recomputes (by :attr:`Piece.module_start`),
    given ``k`` per module (``modules.recompute_first``): a module whose KV is already a full prefill's (``exact``,
    e.g. an encoding exact where it stands, ``kvreuse.modules.encodings``) recomputes none, and the budget ``k``
    gave it goes to the others, spread as evenly as their lengths allow (water-filling: every other module takes
    the same count, a short one all its tokens, the few tokens left over one each to the first modules that can
    take more). The total is what ``k`` per module
    recomputes; where every module is exact, nothing is.

    The allotment depends on the whole run, not on where an engine's prefix hit ended inside it: callers pass the
    whole run, so a module's count is the same for every request that splices the same run, and can name the
    module's cache blocks (an adapter folds it into their hashes).
    """
    budget = sum(min(piece.length + piece.offset, k) for piece in run)
    others = [piece for piece in run if not exact(piece)]
    counts = dict.fromkeys((piece.module_start for piece in run), 0)
    sizes = {piece.module_start: piece.length + piece.offset for piece in others}  # tokens each can recompute
    left = min(budget, sum(sizes.values()))
    level = 0
    for n, size in enumerate(sorted(sizes.values())):  # raise every open module's count together
        rise = min(size - level, left // (len(sizes) - n))
        level += rise
        left -= rise * (len(sizes) - n)
        if size > level:
            break
    for start, size in sizes.items():
        counts[start] = min(size, level)
    for start, size in sizes.items():  # the remainder, one token each, in prompt order
        if left and size > level:
            counts[start] += 1
            left -= 1
    return counts


def budgeted_tokens(
    run: Sequence[Piece], share: float, exact: Callable[[Piece], bool], scores: Mapping[Hashable, Sequence[float]]
) -> dict[int, tuple[int, ...]]:
    """One budget of recomputed tokens for a whole spliced ``run`` (``modules.recompute_budget``): ``share`` (0
    to 1) of the run's module tokens, spent on the tokens of its inexact modules that most need it, as known before
    the request. By :attr:`Piece.module_start`, the indices (from the module's first token, ascending) of the tokens
    each module recomputes; a module whose KV is already a full prefill's (``exact``) gets none, and its tokens'
    share goes to the others.

    A token's need is the share of its full-prefill context that the splice hides from it, ``s / (s + i + 1)``
    for token ``i`` of a module that starts at prompt position ``s`` (encoded alone, it attended to its module's
    ``i + 1`` tokens only; under uniform attention that is the attention mass it lacks), times its encode-time
    deviation relative to its module's mean (``scores[name]``, ``kvreuse.modules.blend.token_scores``: CacheBlend's
    distance against the probe; a module without scores weighs its tokens alike). So the position sets how much
    each module gets (later modules, and longer ones, more; a module right after the prompt's start little), and
    the probe which of its tokens (without one, its first tokens, LegoLink's choice). The top ``round(share x
    tokens)`` needs are taken over the whole run (ties: the earlier token). Our allocation, combining the per-token
    deviation of CacheBlend (Yao et al., EuroSys 2025) and Cache-Craft's position-aware choice of how much of each
    chunk to recompute (Agarwal et al., SIGMOD 2025) without a per-request pass.

    Like :func:`allot_first_tokens`, the choice depends on the whole run only (callers pass it from its first
    module), so it can name the modules' cache blocks.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recompute budget {share!r} is not between 0 and 1")
    total = sum(piece.length + piece.offset for piece in run)
    needs: list[tuple[float, int, int]] = []  # (-need, module start, token index)
    for piece in run:
        if exact(piece):
            continue
        size = piece.length + piece.offset
        own = scores.get(piece.name, ())
        mean = sum(own) / len(own) if len(own) == size else 0.0
        s = piece.module_start
        for i in range(size):
            weight = own[i] / mean if mean > 0.0 else 1.0
            needs.append((-(s / (s + i + 1)) * weight, s, i))
    needs.sort()
    chosen: dict[int, list[int]] = {piece.module_start: [] for piece in run}
    for _, start, i in needs[: round(share * total)]:
        chosen[start].append(i)
    return {start: tuple(sorted(indices)) for start, indices in chosen.items()}


def budget_positions(pieces: Sequence[Piece], chosen: Mapping[int, Sequence[int]]) -> tuple[int, ...]:
    """Prompt positions, ascending, of the pieces' tokens that :func:`budgeted_tokens` chose (``chosen``, by module
    start); a piece that starts inside its module recomputes only the chosen tokens still in it."""
    return tuple(
        piece.prompt_start + i - piece.offset
        for piece in pieces
        for i in chosen.get(piece.module_start, ())
        if piece.offset <= i < piece.offset + piece.length
    )


def chosen_tokens(pieces: Sequence[Piece], rankings: Mapping[Hashable, Sequence[int]], share: float) -> tuple[int, ...]:
    """Prompt positions, ascending, of the pieces' tokens that are among the top ``share`` (0 to 1) of their
    module's ranking: the tokens chosen when the module was encoded (``kvreuse.modules.blend``: CacheBlend's
    deviation, measured against a probe context instead of the request).

    ``rankings[name]`` lists every token index of the module (relative to its first token), most deviating first;
    a module of ``n`` tokens recomputes its first ``ceil(share * n)``. A module without a ranking (encoded without
    a probe) recomputes nothing here. A piece that starts inside its module (the engine's prefix hit ended there)
    recomputes only the chosen tokens still in it.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"recompute share {share!r} is not between 0 and 1")
    positions: list[int] = []
    for piece in pieces:
        ranking = rankings.get(piece.name, ())
        count = math.ceil(round(share * len(ranking), 9))
        positions += [
            piece.prompt_start + i - piece.offset
            for i in sorted(ranking[:count])
            if piece.offset <= i < piece.offset + piece.length
        ]
    return tuple(positions)


def merge_positions(*choices: Sequence[int]) -> tuple[int, ...]:
    """The union of several choices of positions to recompute, ascending (e.g. LegoLink's first tokens and the
    encode-time choice)."""
    return tuple(sorted({p for choice in choices for p in choice}))


def true_positions(first: int, count: int, start: int, recompute: Sequence[int]) -> list[int]:
    """The prompt positions of a step's ``count`` scheduled tokens of one request, the engine having scheduled
    positions ``first ..`` of a prompt whose spliced run keeps ``recompute`` (ascending) to compute.

    The engine counts the run's loaded tokens as computed, ``start`` of them in all, so it schedules
    ``len(recompute)`` more tokens from ``start`` on, then the rest of the prompt. Those first scheduled tokens
    are really the tokens at ``recompute``; as ``start + len(recompute)`` is the run's end, every token after
    them keeps its own position.
    """
    return [recompute[p - start] if start <= p < start + len(recompute) else p for p in range(first, first + count)]


class SkipReason(StrEnum):
    """Why a module found in a prompt was not spliced (the ``reason`` label of
    ``kvreuse:module_splice_skipped_total``)."""

    NOT_STORED = "not_stored"  # the store does not hold it (evicted, or not encoded yet)
    AFTER_FREE_TEXT = "after_free_text"  # free text, or a module not spliced, comes first and ends the run
    PROMPT_END = "prompt_end"  # it starts at the prompt's last token, which the engine must compute
    TOKEN_BOUNDARY = "token_boundary"  # the text after it merged with its last token: its tokens are not in the prompt
    OTHER_ADAPTER = "other_adapter"  # stored only as computed with another adapter (LoRA) than the request's
    NON_TOKEN_INPUT = "non_token_input"  # the request feeds the model more than token ids (multimodal, embeddings)


@dataclass(frozen=True)
class Skipped:
    """Module ``name``, at prompt token ``start``, was not spliced because of ``reason``."""

    name: Hashable
    start: int
    reason: SkipReason


def skipped_modules(
    matches: Sequence[ModuleMatch],
    pieces: Sequence[Piece],
    start: int,
    stop: int,
    available: Callable[[Hashable], bool],
    near_misses: Sequence[ModuleMatch] = (),
) -> list[Skipped]:
    """The modules of a prompt that :func:`plan_splice` (called with the same arguments, giving ``pieces``) did not
    splice, each with its reason, in prompt order; ``near_misses`` (from ``ModuleTrie.near_misses``) are added as
    :attr:`SkipReason.TOKEN_BOUNDARY`. Modules inside the engine's own prefix hit (ending by ``start``) are not
    skipped: they are cached already."""
    end = pieces[-1].prompt_end if pieces else start
    skipped = []
    for match in matches:
        if match.end <= start or match.start < end:
            continue  # cached by the engine, or spliced
        if match.start >= stop:
            reason = SkipReason.PROMPT_END
        elif not available(match.name):
            reason = SkipReason.NOT_STORED
        else:
            reason = SkipReason.AFTER_FREE_TEXT
        skipped.append(Skipped(match.name, match.start, reason))
    skipped += [Skipped(m.name, m.start, SkipReason.TOKEN_BOUNDARY) for m in near_misses]
    return sorted(skipped, key=lambda s: s.start)


def block_modules(
    matches: Sequence[ModuleMatch], block_size: int, first_block: int, num_blocks: int
) -> dict[int, tuple[ModuleMatch, ...]]:
    """For each block ``first_block <= b < num_blocks`` (tokens ``[b * block_size, (b + 1) * block_size)``) that
    holds tokens of a module of ``matches`` (sorted and disjoint), those modules in prompt order."""
    blocks: dict[int, list[ModuleMatch]] = {}
    for match in matches:
        first = max(match.start // block_size, first_block)
        last = min((match.end - 1) // block_size, num_blocks - 1)
        for block in range(first, last + 1):
            blocks.setdefault(block, []).append(match)
    return {block: tuple(found) for block, found in blocks.items()}


def token_slots(block_ids: Sequence[int], block_size: int, start: int, stop: int) -> list[int]:
    """Paged-cache slots (``block * block_size + offset``) of a request's tokens ``[start, stop)``.

    The linear slot does not change when an engine splits its blocks into smaller kernel blocks, so the result
    indexes any per-layer view whose block size divides ``block_size``.
    """
    if stop > len(block_ids) * block_size:
        raise ValueError(
            f"tokens up to {stop} need {-(-stop // block_size)} blocks of {block_size}, "
            f"the request has {len(block_ids)}"
        )
    return [block_ids[t // block_size] * block_size + t % block_size for t in range(start, stop)]


def piece_kv(
    module: EncodedModule, piece: Piece, spec: RopeSpec, device: torch.device | str, length: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of ``module``, in order: the keys and values of the piece's first ``length`` tokens (default
    all) on ``device``, keys moved to the prompt positions the piece takes. What an engine adapter writes into its
    own cache."""
    length = piece.length if length is None else length
    part = slice(piece.offset, piece.offset + length)
    deltas = torch.full((length,), piece.delta(module.start), dtype=torch.int64)
    keys = module.kv[:, 0, part].to(device)  # [layers, tokens, kv_heads, head_dim]
    layers, tokens, heads, dim = keys.shape
    # One move for every layer (they share the piece's delta), the layers as more heads: the same arithmetic per key
    # as a move per layer, without a move's fixed cost per layer (on CPU, the angles and the float64 round trip).
    moved = move_keys(keys.transpose(0, 1).reshape(tokens, layers * heads, dim), deltas, spec)
    moved = moved.view(tokens, layers, heads, dim)
    for layer in range(layers):
        yield moved[:, layer].contiguous(), module.values(layer)[part].to(device)
