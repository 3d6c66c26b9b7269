"""Which stored encoding of a module a prompt takes: what its KV was computed with and after.

A module's KV depends on more than its tokens: on the adapter the model ran with (a LoRA adapter changes the
keys and values of every layer it touches) and on the tokens its attention saw before it (its *context*: none for
a module encoded alone, the chat header, a neighbouring module, the tables a database table references). The store
may hold several encodings of one module (``kvreuse.modules.store``: one name, the same tokens, several contexts
and adapters), each an :class:`Encoding`. For each module found in a prompt, :func:`choose_encoding` takes the one
that fits the request:

* only an encoding computed with the request's own adapter (``""``: none): KV of another adapter is wrong KV, never
  an approximation, so a module without one is not spliced;
* among those, an encoding whose context is exactly the prompt's tokens before the module, at the same position,
  is *exact*: its KV is what a full prefill computes there (nothing of it needs recomputing);
* else the one whose context *matches* the prompt with the most tokens: its context is the prompt's first tokens
  followed by the tokens right before the module (either part may be empty: "after the header", "after its
  neighbour", both), so every token its attention saw is in this prompt, only the middle is missing; a module
  encoded alone (no context) matches every prompt, with none;
* else the module's first encoding for that adapter (the one that bound its name, ``primary``), spliced as before
  encodings per context existed; an encoding with a context that does not match is never taken otherwise, so no
  request splices KV that attended to tokens its prompt does not hold, except the name's own first encoding.

The choice depends only on the prompt, the request's adapter and the stored encodings (ties: the primary, then
the lowest version), never on what else the engine runs, so the same prompt always gets the same KV.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

NO_ADAPTER = ""  # the base model


class EncodingMatch(StrEnum):
    """How the encoding a prompt took fits it (the ``match`` label of ``kvreuse:module_encodings_taken_total``)."""

    EXACT = "exact"  # its context is the prompt's tokens before the module: a full prefill's KV
    CONTEXT = "context"  # its context is the prompt's start and/or the tokens right before the module
    ALONE = "alone"  # encoded without a context (and the module does not start the prompt)
    UNMATCHED = "unmatched"  # no stored context fits: the module's first encoding, as spliced before


@dataclass(frozen=True)
class Encoding:
    """One stored encoding of a module: ``key`` (a ``ModuleKey``), the adapter its KV was computed with, the token
    ids it was encoded after (``context``), the position of its first token (``start``, ``len(context)`` for an
    engine's encode request) and whether it is its name's first encoding for that adapter (``primary``)."""

    key: Hashable
    adapter: str
    context: tuple[int, ...]
    start: int
    primary: bool
    version: int = 0


@dataclass(frozen=True)
class Choice:
    """The encoding a prompt takes for one module, and how it fits."""

    key: Hashable
    match: EncodingMatch
    context_tokens: int  # tokens of its context that the prompt holds where the encoding saw them (or not)

    @property
    def exact(self) -> bool:
        return self.match is EncodingMatch.EXACT


def context_fits(context: Sequence[int], prompt: Sequence[int], position: int) -> bool:
    """Whether ``context`` is the first ``a`` tokens of ``prompt`` followed by the ``len(context) - a`` tokens right
    before ``position``, for some ``a``: the tokens an encoding saw are the prompt's start and those right before
    the module at ``position``. Costs at most ``len(context)`` comparisons."""
    n = len(context)
    if n > position:
        return False
    head = 0
    while head < n and context[head] == prompt[head]:
        head += 1
    tail = 0
    while tail < n - head and context[n - 1 - tail] == prompt[position - 1 - tail]:
        tail += 1
    return head + tail >= n


def choose_encoding(encodings: Iterable[Encoding], prompt: Sequence[int], position: int, adapter: str) -> Choice | None:
    """The encoding a module at ``position`` of ``prompt`` takes under ``adapter`` (module docstring), or ``None``
    where none was computed with that adapter."""
    own = sorted((e for e in encodings if e.adapter == adapter), key=lambda e: (not e.primary, e.version))
    if not own:
        return None
    for encoding in own:
        if encoding.start == position == len(encoding.context) and context_fits(encoding.context, prompt, position):
            return Choice(encoding.key, EncodingMatch.EXACT, position)
    fitting = [e for e in own if context_fits(e.context, prompt, position)]
    if fitting:
        best = max(fitting, key=lambda e: len(e.context))  # max keeps the first of equals: primary, then oldest
        match = EncodingMatch.CONTEXT if best.context else EncodingMatch.ALONE
        return Choice(best.key, match, len(best.context))
    primary = next((e for e in own if e.primary), None)
    return None if primary is None else Choice(primary.key, EncodingMatch.UNMATCHED, 0)
