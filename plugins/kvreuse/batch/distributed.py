"""Batch jobs over several engine replicas: stream, bucket by prefix, route, retry, answer by row id.

The dispatcher (:func:`answer_stream`) is engine-free. Rows ``(row_id, prompt)`` flow through the streaming
prefix bucketing (:func:`kvreuse.reorder.bucket_stream`, bounded buffer); each bucket is cut into batches of at
most ``batch_size`` prompts, and each batch is routed (:mod:`kvreuse.reorder.routing`, prefix-aware by default,
keyed by the chained hashes of the batch's shared leading blocks) to one replica of a :class:`ReplicaPool`. At
most ``inflight`` unfinished requests per live replica are outstanding, so memory stays bounded however long
the stream. A replica that dies is removed from the router and every batch it had not answered is routed again
to a live one.

Invariant: every row id given is answered exactly once — a retried batch is one whose answers never arrived,
and an answer for a row already answered is dropped (counted in ``JobFigures.duplicates_dropped``).

Pools: :class:`InProcessReplicas` (backends in this process, no Ray: what ``--replicas 1`` uses) and
:class:`kvreuse.vllm.ray_replicas.RayVLLMReplicas` (one ``vllm.LLM`` per Ray actor).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvreuse.batch.backend import MAX_TOKENS, Backend, Completion
from kvreuse.batch.job import sum_known
from kvreuse.errors import BackendError, ConfigError
from kvreuse.reorder.bucketing import bucket_stream, common_prefix_length
from kvreuse.reorder.routing import make_router, prefix_keys


class ReplicaDied(BackendError):
    """A replica stopped (its actor died); its unanswered batches are routed again."""


@dataclass(frozen=True)
class Batch:
    """Prompts sent together to one replica; ``rows[i]`` is the row id ``prompts[i]`` asks about."""

    rows: tuple[Hashable, ...]
    prompts: tuple[str, ...]
    keys: tuple[bytes, ...]


class ReplicaPool(Protocol):
    """Replicas ``0..size-1`` that answer batches asynchronously.

    ``submit`` starts a batch on a replica and returns a handle; ``wait`` blocks until at least one submitted
    batch is done and returns ``(handle, completions)`` pairs, where ``completions`` is the batch's answers in
    prompt order or a :class:`ReplicaDied` instance when the replica died before answering.
    """

    size: int

    def submit(self, replica: int, prompts: Sequence[str], *, max_tokens: int) -> Hashable: ...

    def wait(self, handles: Sequence[Hashable]) -> list[tuple[Hashable, list[Completion] | ReplicaDied]]: ...


class InProcessReplicas:
    """Backends in this process as a pool (no Ray). ``submit`` answers at once; ``wait`` hands answers back."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        if not backends:
            raise ConfigError("an in-process pool needs at least one backend")
        self.backends = list(backends)
        self.size = len(self.backends)
        self._done: dict[int, list[Completion]] = {}
        self._next = 0

    def submit(self, replica: int, prompts: Sequence[str], *, max_tokens: int) -> int:
        self._next += 1
        self._done[self._next] = self.backends[replica].generate(list(prompts), max_tokens=max_tokens)
        return self._next

    def wait(self, handles: Sequence[Hashable]) -> list[tuple[Hashable, list[Completion] | ReplicaDied]]:
        return [(h, self._done.pop(h)) for h in handles]


@dataclass
class ReplicaFigures:
    """One replica's share of a job; token counts are ``None`` when its engine did not report them."""

    replica: int
    batches: int = 0
    requests: int = 0
    prompt_tokens: int | None = 0
    cached_tokens: int | None = 0
    died: bool = False
    errors: int = 0  # prompts the engine refused (their completions carry the error)

    @property
    def hit_rate(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens


@dataclass
class JobFigures:
    """What a multi-replica job did: per replica figures, retries, and wall time."""

    router: str
    replicas: list[ReplicaFigures]
    requests: int = 0
    retried_batches: int = 0
    retried_requests: int = 0
    duplicates_dropped: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int | None:
        return sum_known(r.prompt_tokens for r in self.replicas)

    @property
    def cached_tokens(self) -> int | None:
        return sum_known(r.cached_tokens for r in self.replicas)

    @property
    def hit_rate(self) -> float | None:
        cached, prompt = self.cached_tokens, self.prompt_tokens
        return None if cached is None or not prompt else cached / prompt

    @property
    def throughput(self) -> float:
        """Requests answered per second of wall time."""
        return self.requests / self.wall_s if self.wall_s else 0.0

    def summary(self) -> str:
        """Lines for a terminal: totals, then one line per replica."""

        def count(value: int | None) -> str:
            return "n/a" if value is None else f"{value:,}"

        rate = self.hit_rate
        lines = [
            f"rows           {self.requests:,} over {len(self.replicas)} replica(s), router {self.router}",
            f"prompt tokens  {count(self.prompt_tokens)}",
            f"cached tokens  {count(self.cached_tokens)}" + ("" if rate is None else f" ({rate:.1%} hit rate)"),
            f"time           {self.wall_s:.1f} s wall, {self.throughput:.1f} rows/s",
            f"retried        {self.retried_batches} batch(es), {self.retried_requests} row(s)",
        ]
        errors = sum(r.errors for r in self.replicas)
        if errors:
            lines.append(f"errors         {errors:,} row(s) refused by the engines; their error column says why")
        for r in self.replicas:
            hit = "" if r.hit_rate is None else f", {r.hit_rate:.1%} hit rate"
            lines.append(
                f"  replica {r.replica}: {r.requests:,} rows in {r.batches} batches{hit}"
                + (" (died)" if r.died else "")
            )
        return "\n".join(lines)


def answer_stream(
    rows: Iterable[tuple[Hashable, str]],
    pool: ReplicaPool,
    *,
    router: str = "prefix-aware",
    max_tokens: int = MAX_TOKENS,
    batch_size: int = 16,
    buffer_size: int = 1024,
    inflight: int = 64,
    key_block: int = 64,
    router_options: dict | None = None,
    bucket: bool = True,
    figures: JobFigures | None = None,
    progress: Any = None,
) -> Iterator[tuple[Hashable, Completion]]:
    """Answer every ``(row_id, prompt)`` of ``rows`` on ``pool``; yield ``(row_id, completion)`` as they finish.

    Row ids must be distinct and hashable (a repeat of a row not yet answered is an error; only rows not yet
    answered are remembered, so memory stays bounded). ``batch_size`` caps a routed batch; ``buffer_size`` is
    the bucketing buffer; ``inflight`` caps unfinished requests per live replica (at least one batch is always
    in flight); ``key_block`` is the length, in characters, of the prompt blocks hashed into prefix keys.
    ``router_options`` go to the router (default for ``prefix-aware``: ``slack`` of half the in-flight cap, at
    least one batch: locality may cost at most that much imbalance of unfinished requests). ``bucket=False``
    skips the bucketing: batches are consecutive rows as given (the baseline of a job that orders rows itself,
    or not at all). ``figures`` (from :func:`new_figures`) is filled in as the job runs; ``progress`` is
    anything with ``update(n)`` (a tqdm bar).
    """
    for name, value in (
        ("batch_size", batch_size),
        ("buffer_size", buffer_size),
        ("inflight", inflight),
        ("key_block", key_block),
        ("max_tokens", max_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    figures = figures if figures is not None else new_figures(pool.size, router)
    if router == "prefix-aware" and router_options is None:
        router_options = {"slack": max(batch_size, inflight // 2)}
    routing = make_router(router, pool.size, **(router_options or {}))
    started = time.perf_counter()
    open_rows: set[Hashable] = set()  # taken from the stream, not answered yet: bounded by buffer + in flight
    outstanding: dict[Hashable, tuple[int, Batch]] = {}
    retry: list[Batch] = []
    live = set(range(pool.size))

    def checked(stream: Iterable[tuple[Hashable, str]]) -> Iterator[tuple[Hashable, str]]:
        for row, prompt in stream:
            if row in open_rows:
                raise ConfigError(f"row id {row!r} is given twice; row ids must be distinct")
            open_rows.add(row)
            yield row, prompt

    def batches() -> Iterator[Batch]:
        if bucket:
            buckets = bucket_stream(
                checked(rows), lambda item: item[1], buffer_size=buffer_size, min_bucket=min(batch_size, buffer_size)
            )
        else:
            buckets = _chunks(checked(rows), batch_size)
        for group in buckets:
            for start in range(0, len(group), batch_size):
                part = group[start : start + batch_size]
                shared = part[0][1][: common_prefix_length(part[0][1], part[-1][1])]
                yield Batch(tuple(r for r, _ in part), tuple(p for _, p in part), tuple(prefix_keys(shared, key_block)))

    def send(batch: Batch) -> None:
        replica = routing.route(batch.keys, len(batch.rows))
        handle = pool.submit(replica, batch.prompts, max_tokens=max_tokens)
        outstanding[handle] = (replica, batch)
        figures.replicas[replica].batches += 1

    def unfinished() -> int:
        return sum(len(b.rows) for _, b in outstanding.values())

    def collect() -> Iterator[tuple[Hashable, Completion]]:
        for handle, result in pool.wait(list(outstanding)):
            replica, batch = outstanding.pop(handle)
            if isinstance(result, ReplicaDied):
                if replica in live:
                    live.discard(replica)
                    routing.remove(replica)
                    figures.replicas[replica].died = True
                retry.append(batch)
                figures.retried_batches += 1
                figures.retried_requests += len(batch.rows)
                continue
            if len(result) != len(batch.prompts):
                raise BackendError(
                    f"replica {replica} returned {len(result)} completion(s) for {len(batch.prompts)} prompt(s)"
                )
            routing.finish(replica, len(batch.rows))
            _count(figures.replicas[replica], result)
            for row, completion in zip(batch.rows, result):
                if row not in open_rows:
                    figures.duplicates_dropped += 1
                    continue
                open_rows.discard(row)
                figures.requests += 1
                if progress is not None:
                    progress.update(1)
                yield row, completion

    source = batches()
    pending = next(source, None)
    while pending is not None or retry or outstanding:
        if not live:
            raise BackendError("every replica died; the job cannot finish")
        # Fill: retries first, then new batches, while under the in-flight cap (always at least one batch).
        while True:
            batch = retry[0] if retry else pending
            if batch is None or (outstanding and unfinished() + len(batch.rows) > inflight * len(live)):
                break
            send(batch)
            if retry:
                retry.pop(0)
            else:
                pending = next(source, None)
        if outstanding:
            yield from collect()
        figures.wall_s = time.perf_counter() - started
    figures.wall_s = time.perf_counter() - started


def answer_rows(prompts: Sequence[str], pool: ReplicaPool, **options: Any) -> tuple[list[Completion], JobFigures]:
    """Completions of ``prompts`` in their order (row id = position), and the job's figures.

    ``options`` are those of :func:`answer_stream`, except ``figures``.
    """
    figures = new_figures(pool.size, options.get("router", "prefix-aware"))
    answers: list[Completion | None] = [None] * len(prompts)
    for row, completion in answer_stream(enumerate(prompts), pool, figures=figures, **options):
        answers[row] = completion
    missing = [i for i, a in enumerate(answers) if a is None]
    if missing:  # cannot happen while the invariant holds; a user-facing guard all the same
        raise BackendError(f"{len(missing)} row(s) were never answered, e.g. row {missing[0]}")
    return answers, figures  # type: ignore[return-value]


def _chunks(items: Iterable[tuple[Hashable, str]], size: int) -> Iterator[list[tuple[Hashable, str]]]:
    chunk: list[tuple[Hashable, str]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def new_figures(replicas: int, router: str) -> JobFigures:
    return JobFigures(router, [ReplicaFigures(r) for r in range(replicas)])


def _count(replica: ReplicaFigures, completions: Sequence[Completion]) -> None:
    """Add a batch to a replica's figures; refused prompts count as requests and errors, not as tokens."""
    answered = [c for c in completions if c.error is None]
    replica.requests += len(completions)
    replica.errors += len(completions) - len(answered)
    replica.prompt_tokens = sum_known([replica.prompt_tokens, *(c.prompt_tokens for c in answered)])
    replica.cached_tokens = sum_known([replica.cached_tokens, *(c.cached_tokens for c in answered)])
