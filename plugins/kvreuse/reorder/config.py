"""Settings of the ``reorder`` plugin (the GGR solver and the prefix-affinity scheduler)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvreuse import config


@dataclass(frozen=True)
class ReorderConfig:
    """Settings of request reordering; see the README's table of flags.

    In vLLM they are read from ``--additional-config '{"kvreuse": {"reorder": {...}}}'`` or ``KVREUSE_REORDER_*``.
    The waiting bound trades hit rate for latency: a request passed over ``max_skips`` times is admitted in
    arrival order, so none waits more than ``max_skips`` admissions of later arrivals beyond its place in arrival
    order, however long the backlog. ``max_wait_s`` adds a bound in seconds, off by default: a fixed number of
    seconds turns the policy off exactly when a backlog makes regrouping pay (a backlog that takes two minutes to
    drain makes every request due after ten seconds).
    """

    max_skips: int = config.setting(
        64, "scheduler: most times a waiting request may be passed over by a later one", low=0, high=1_000_000
    )
    max_wait_s: float = config.setting(
        float("inf"), "scheduler: seconds after arrival past which a request is admitted in arrival order", low=0.0
    )
    admit_to_completion: bool = config.setting(
        True,
        "scheduler: admit a waiting request only while the KV cache can hold it and every running request up to "
        "their max_tokens (fewer preemptions)",
    )
    lookahead: int = config.setting(
        256, "scheduler: how many waiting requests are scanned for prefix affinity per step", low=1, high=1_000_000
    )
    max_depth: int = config.setting(
        64, "GGR: recursion depth past which the rest is ordered by the statistics-based fixed order", low=1
    )
    min_group_hit: float = config.setting(
        0.0, "GGR: stop recursing into groups whose best hit value is at most this", low=0.0
    )
    discover_fds: bool = config.setting(True, "GGR: discover exact functional dependencies from the data")

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> ReorderConfig:
        return config.load(cls, "reorder", flags, environ)
