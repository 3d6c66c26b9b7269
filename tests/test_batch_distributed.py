"""The multi-replica dispatcher, on fake replicas: every row answered once, in row order, through deaths."""

from __future__ import annotations

import random

import pytest

from kvreuse.batch import Completion
from kvreuse.batch.distributed import InProcessReplicas, ReplicaDied, answer_rows, answer_stream
from kvreuse.errors import BackendError, ConfigError


class FakeReplicas:
    """Replicas that answer ``prompt.upper()`` one batch per ``wait``, in random order; a replica in
    ``doomed`` dies after answering ``die_after`` batches, failing everything it still holds."""

    def __init__(self, size: int, *, doomed: set[int] = frozenset(), die_after: int = 0, seed: int = 0) -> None:
        self.size = size
        self.doomed, self.die_after = set(doomed), die_after
        self.sent: dict[int, list[tuple[str, ...]]] = {r: [] for r in range(size)}
        self.answered = {r: 0 for r in range(size)}
        self.dead: set[int] = set()
        self._handles: dict[int, tuple[int, tuple[str, ...]]] = {}
        self._random = random.Random(seed)

    def submit(self, replica, prompts, *, max_tokens):
        self.sent[replica].append(tuple(prompts))
        self._handles[len(self._handles)] = (replica, tuple(prompts))
        return len(self._handles) - 1

    def wait(self, handles):
        handle = self._random.choice(list(handles))
        replica, prompts = self._handles[handle]
        if replica in self.dead:
            return [(handle, ReplicaDied(f"replica {replica} died"))]
        if replica in self.doomed and self.answered[replica] >= self.die_after:
            self.dead.add(replica)
            return [(handle, ReplicaDied(f"replica {replica} died"))]
        self.answered[replica] += 1
        return [(handle, [Completion(p.upper(), len(p), len(p) // 2) for p in prompts])]


def prompts_with_prefixes(n: int, prefixes: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    heads = [f"instruction\ngroup {g}: " + "context " * 20 for g in range(prefixes)]
    return [heads[rng.randrange(prefixes)] + f"row {i}" for i in range(n)]


def test_answers_come_back_in_row_order():
    prompts = prompts_with_prefixes(500, 7)
    answers, figures = answer_rows(prompts, FakeReplicas(3), batch_size=8, buffer_size=64, inflight=16)
    assert [a.text for a in answers] == [p.upper() for p in prompts]
    assert figures.requests == 500 and sum(r.requests for r in figures.replicas) == 500
    assert figures.hit_rate == pytest.approx(sum(len(p) // 2 for p in prompts) / sum(map(len, prompts)))


def test_a_dead_replicas_unfinished_rows_are_answered_once_elsewhere():
    prompts = prompts_with_prefixes(400, 5)
    pool = FakeReplicas(3, doomed={1}, die_after=3)
    answered = list(answer_stream(enumerate(prompts), pool, batch_size=8, buffer_size=64, inflight=16))
    rows = [row for row, _ in answered]
    assert sorted(rows) == list(range(400))  # none lost, none twice
    assert all(c.text == prompts[row].upper() for row, c in answered)
    assert pool.dead == {1}


def test_retries_are_counted_and_the_dead_replica_is_marked():
    prompts = prompts_with_prefixes(300, 4)
    answers, figures = answer_rows(
        prompts, FakeReplicas(2, doomed={0}, die_after=2), batch_size=8, buffer_size=64, inflight=32
    )
    assert [a.text for a in answers] == [p.upper() for p in prompts]
    assert figures.replicas[0].died and not figures.replicas[1].died
    assert figures.retried_batches >= 1 and figures.retried_requests >= 1
    assert figures.replicas[0].requests + figures.replicas[1].requests == 300


def test_the_job_fails_with_a_clear_error_when_every_replica_dies():
    with pytest.raises(BackendError, match="every replica died"):
        answer_rows(prompts_with_prefixes(100, 3), FakeReplicas(2, doomed={0, 1}, die_after=1), batch_size=4)


def test_prefix_aware_routing_keeps_each_prefix_on_few_replicas():
    prompts = prompts_with_prefixes(2000, 8)
    spread = {}
    for router in ("round-robin", "prefix-aware"):
        pool = FakeReplicas(4)
        _, figures = answer_rows(
            prompts,
            pool,
            router=router,
            batch_size=8,
            buffer_size=128,
            inflight=64,
            router_options={"slack": 64} if router == "prefix-aware" else None,
        )
        assert all(400 <= r.requests <= 600 for r in figures.replicas)  # 500 each would be even
        groups = {r: {p.split(":")[0] for batch in pool.sent[r] for p in batch} for r in range(4)}
        spread[router] = sum(len(g) for g in groups.values())  # (replica, prefix) pairs: 8 is perfect
    assert spread["round-robin"] == 32
    assert spread["prefix-aware"] <= 10


def test_in_process_replicas_wrap_any_backend():
    class Upper:
        cache_model = None

        def generate(self, prompts, *, max_tokens, progress=False):
            return [Completion(p.upper(), None, None) for p in prompts]

    prompts = prompts_with_prefixes(50, 3)
    answers, figures = answer_rows(prompts, InProcessReplicas([Upper()]), batch_size=4)
    assert [a.text for a in answers] == [p.upper() for p in prompts]
    assert figures.hit_rate is None and "n/a" in figures.summary()


def test_row_ids_must_be_distinct():
    with pytest.raises(ConfigError, match="row id 'a' is given twice"):
        list(answer_stream([("a", "x"), ("a", "y")], FakeReplicas(1), buffer_size=4))


def test_cli_replicas_need_a_local_model_not_a_server_url(capsys, tmp_path):
    from kvreuse.cli import main

    table = tmp_path / "t.csv"
    table.write_text("title\nHeat\n")
    code = main(["run", "--table", str(table), "--prompt", "Kids?", "--url", "http://127.0.0.1:9", "--replicas", "2"])
    assert code == 1
    assert "--replicas starts engine replicas and needs --model" in capsys.readouterr().err


def test_without_bucketing_batches_are_consecutive_rows_as_given():
    prompts = [f"p{i}" for i in range(10)]
    pool = FakeReplicas(1)
    answers, _ = answer_rows(prompts, pool, batch_size=4, bucket=False, router="round-robin")
    assert pool.sent[0] == [("p0", "p1", "p2", "p3"), ("p4", "p5", "p6", "p7"), ("p8", "p9")]
    assert [a.text for a in answers] == [p.upper() for p in prompts]
