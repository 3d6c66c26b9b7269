"""What a job's order saved against the table's own order: the engine's count of the job, the plan of the other.

The engine counts what the job computed: each answered row's prompt tokens and those its prefix cache served
(vLLM's ``num_cached_tokens``; a server's ``usage.prompt_tokens_details.cached_tokens``). What the table's own
order (its rows and fields as given) would have computed is not counted, since that would run the job twice: it
is planned, by replaying its prompts through a model of the engine's prefix cache
(:func:`kvreuse.batch.calibrate.planned_stats`: the engine's tokens, framed by the chat template as sent, whole
blocks only, the engine's cache size). The job's own prompts are planned the same way, so the summary shows the
plan's error on this very job beside the comparison: a user sees how far the planned figure can be trusted.

No wall time saved is estimated. An earlier estimate (prefill tokens saved times a per-token cost timed by a probe
after the job) ranged from 1.0 s to 12.2 s over five runs of one plan, and on the project's benchmark its error
against the measured difference ran from 5% to 317% (``benchmarks/reorder_chat_orders.py``): the two
passes of a probe differ by a few hundred milliseconds, under the noise of a shared machine. The summary gives
the times it measured and none it did not.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.reorder import BlockHitStats

# A field order whose plan computes at most this share of the job's planned prefill is worth naming in the summary
# (1.25x fewer tokens or better): below that, a change of field order, which can change answers, is not worth it.
WORTH_NAMING = 0.8


@dataclass(frozen=True)
class PrefillReport:
    """The figures of a job's prefill: as the engine counted it (``prompt_tokens``, ``cached_tokens``: ``None``
    where it did not report them), as planned for the job's own prompts (``planned``) and for the same rows in the
    table's own order (``original``), in ``units`` (tokens; characters where the engine's tokenizer is unknown)."""

    prompt_tokens: int | None
    cached_tokens: int | None
    planned: BlockHitStats
    original: BlockHitStats
    units: str

    @property
    def computed_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    def plan_error(self) -> float | None:
        """The plan's error on this job's prompts, relative to the engine's count (``None`` where they cannot be
        compared: no count, or a plan in characters)."""
        counted = self.computed_tokens
        if counted is None or not counted or self.units != "tokens":
            return None
        return (self.planned.computed_tokens - counted) / counted

    def lines(self, *, original_order: bool) -> list[str]:
        """The summary's prefill lines; ``original_order``: the job was sent in the table's own order."""
        counted = self.computed_tokens
        if counted is None:
            first = (
                "prefill        not counted: the engine did not report its prefix-cache hits (vllm serve reports "
                "them with --enable-prompt-tokens-details)"
            )
        else:
            rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0  # type: ignore[operator]
            first = (
                f"prefill        {counted:,} of {self.prompt_tokens:,} prompt tokens computed, {self.cached_tokens:,} "
                f"served from the prefix cache ({rate:.1%}): the engine's count"
            )
        if original_order:
            return [first, "against        nothing: this job was sent in the table's own order"]
        return [first, self._against()]

    def _against(self) -> str:
        original, planned = self.original.computed_tokens, self.planned.computed_tokens
        ratio = f"{original / planned:.2f}x" if planned else "n/a"
        error = self.plan_error()
        if error is not None:
            return (
                f"against        {original:,} tokens computed in the table's own order, planned ({ratio} this "
                f"job's plan of {planned:,}; that plan is {_signed(error)} the engine's count)"
            )
        if self.units == "tokens":
            return (
                f"against        {original:,} tokens computed in the table's own order, planned ({ratio} this job's "
                "plan)"
            )
        return (
            f"against        the table's own order computes {ratio} the prompt characters of this job's order, "
            "planned on characters (the server's tokenizer is unknown)"
        )


def field_order_advice(job: BlockHitStats, alternatives: dict[str, BlockHitStats], units: str) -> str | None:
    """The summary line naming the field order whose plan computes the least, where it computes at most
    :data:`WORTH_NAMING` of the job's plan (``job``: the whole table's plan in the job's field order), with how to
    check its answers; ``None`` where none does."""
    if not alternatives or not job.computed_tokens:
        return None
    name, best = min(alternatives.items(), key=lambda item: item[1].computed_tokens)
    if best.computed_tokens > WORTH_NAMING * job.computed_tokens:
        return None
    return (
        f"field order    --field-order {name} would compute {best.computed_tokens:,} prompt {units}, planned, against "
        f"this job's {job.computed_tokens:,} ({job.computed_tokens / max(best.computed_tokens, 1):.1f}x fewer), but "
        f"moving fields can change answers: --calibrate asks sample rows in each field order and moves them only "
        f"where the answers stay the same"
    )


def _signed(fraction: float) -> str:
    return f"{abs(fraction):.1%} {'over' if fraction > 0 else 'under'}" if fraction else "exactly"
