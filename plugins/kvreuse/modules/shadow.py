"""Shadow checks: a spliced request's first tokens compared with those of the same prompt computed in full (or their
texts, after a user's normaliser).

A splice trades answers for compute (README, "Answer quality of spliced modules"); how many it costs depends on the
prompts a deployment sees, and can drift as they change. A shadow check sends a sampled request twice, as served
(spliced) and with full prefill, under one pair name; :class:`ShadowPairs` keeps the first half to finish until the
second does, and says whether their first tokens agree. An adapter counts the checks and the agreements (the
counters ``kvreuse:module_shadow_checks_total`` and ``..._agreed_total`` in vLLM), so an operator sees the
agreement rate live.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

PENDING_PAIRS = 4096  # halves waiting for their other half (a lost half, e.g. an aborted request, ages out)
COMPARED_TOKENS = 64  # first output tokens kept and compared per half: what is waiting stays bounded


class ShadowPairs:
    """Finished halves of shadow pairs waiting for the other half, at most ``limit`` (the oldest forgotten).
    ``same(full, served)`` says whether two compared outputs agree (default: the same tokens; e.g.
    ``kvreuse.modules.agreement.same_output`` with a user's normaliser)."""

    def __init__(
        self, limit: int = PENDING_PAIRS, same: Callable[[Sequence[int], Sequence[int]], bool] | None = None
    ) -> None:
        self.limit = limit
        self.same = same
        self._waiting: OrderedDict[str, tuple[bool, tuple[int, ...]]] = OrderedDict()

    def finished(self, pair: str, full: bool, tokens: Sequence[int]) -> bool | None:
        """Half ``pair`` (the full prefill if ``full``, else the spliced request) finished with output ``tokens``.
        When the other half has finished too: whether both output the same tokens as far as the shorter goes
        (each stops at its own length or end of turn), at most the first :data:`COMPARED_TOKENS`; ``None`` until
        then, and for a pair with an empty half (nothing to compare) or two halves of the same kind (a client's
        mistake: not a check)."""
        other = self._waiting.pop(pair, None)
        if other is None:
            self._waiting[pair] = (full, tuple(tokens[:COMPARED_TOKENS]))
            while len(self._waiting) > self.limit:
                self._waiting.popitem(last=False)
            return None
        other_full, other_tokens = other
        compared = min(len(tokens), len(other_tokens), COMPARED_TOKENS)
        if other_full == full or not compared:
            return None
        mine, theirs = tuple(tokens[:compared]), other_tokens[:compared]
        if self.same is not None:
            return self.same(theirs, mine) if full is False else self.same(mine, theirs)
        return mine == theirs

    def __len__(self) -> int:
        return len(self._waiting)
