"""Two engine replicas on a local Ray cluster: prefix buckets stay together, a killed replica loses no row.

Each test starts its own pool of two Ray actors, each holding an in-process ``vllm.LLM`` on the small local
model (one CPU each); the reference answers come from one in-process engine without Ray (``--replicas 1``).

The reference is one in-process engine answering every row in one call (``reference``). Answers are compared with it
as text, exactly, which the arithmetic does not promise: a replica takes the rows in batches of 8, so vLLM may take
a prompt in other chunks or next to other requests, other matrix shapes and summation orders (log-probabilities were
seen ~1e-6 apart, ``test_prefix_affinity_scheduler.py``), and a greedy step within that of a near-tie could flip.
The replicas report no log-probabilities through Ray to tell such a tie from a wrong row, which gets a wholly
different answer; so these tests can fail by rounding, though only at a near-tie of ~1e-5 nats; comparing
log-probabilities would need the replicas to return them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import ray  # kvreuse[ray], which `make test` installs: a missing Ray fails this module, it is not skipped

from kvreuse.batch.distributed import InProcessReplicas, answer_rows, answer_stream, new_figures
from kvreuse.localmodel import local_engine_args
from kvreuse.vllm.backend import started_vllm
from kvreuse.vllm.ray_replicas import RayVLLMReplicas

pytestmark = pytest.mark.engine

GROUPS = 4
PER_GROUP = 24
MAX_TOKENS = 8


class RecordingPool:
    """A pool that remembers which replica each prompt was sent to."""

    def __init__(self, pool) -> None:
        self.pool, self.size, self.sent_to = pool, pool.size, {}

    def submit(self, replica, prompts, *, max_tokens):
        for prompt in prompts:
            self.sent_to.setdefault(prompt, []).append(replica)
        return self.pool.submit(replica, prompts, max_tokens=max_tokens)

    def wait(self, handles):
        return self.pool.wait(handles)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    """Rows of four groups, shuffled; each group's prompts share a prefix of a few KV blocks."""
    rng = random.Random(0)
    heads = [
        f"Classify the review.\nmovie: film number {g}\ninfo: " + " ".join(f"w{g}x{i}" for i in range(60))
        for g in range(GROUPS)
    ]
    rows = [
        heads[g] + f"\nreview: row {n} " + " ".join(f"r{n}y{i}" for i in range(12))
        for g in range(GROUPS)
        for n in range(g * PER_GROUP, (g + 1) * PER_GROUP)
    ]
    rng.shuffle(rows)
    return rows


@pytest.fixture(scope="module")
def reference(small_model, prompts) -> list[str]:
    """Greedy answers of one in-process engine, no Ray."""
    engine_args = local_engine_args(small_model)
    with started_vllm(engine_args.pop("model"), **engine_args) as backend:
        answers, _ = answer_rows(prompts, InProcessReplicas([backend]), max_tokens=MAX_TOKENS)
    return [a.text for a in answers]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def pool(cluster, small_model) -> Iterator[RayVLLMReplicas]:
    with RayVLLMReplicas(2, local_engine_args(small_model), num_cpus=1) as replicas:
        yield replicas


def test_shared_prefix_buckets_go_to_one_replica_and_answers_match_one_engine(reference, pool, prompts):
    recording = RecordingPool(pool)
    answers, figures = answer_rows(prompts, recording, max_tokens=MAX_TOKENS, batch_size=8, buffer_size=256)
    assert [a.text for a in answers] == reference
    replicas_of_group = {}
    for prompt, replicas in recording.sent_to.items():
        assert len(replicas) == 1  # sent once
        replicas_of_group.setdefault(prompt.split("\n")[1], set()).update(replicas)
    assert all(len(r) == 1 for r in replicas_of_group.values()), replicas_of_group  # each group on one replica
    assert {r for rs in replicas_of_group.values() for r in rs} == {0, 1}  # and both replicas work
    assert figures.requests == GROUPS * PER_GROUP
    assert figures.hit_rate > 0.5  # each group's prefix is computed once, on its replica


def test_a_killed_replica_loses_no_row_and_answers_none_twice(reference, pool, prompts):
    answered, killed = [], False
    figures = new_figures(pool.size, "least-loaded")
    stream = answer_stream(
        enumerate(prompts),
        pool,
        router="least-loaded",
        max_tokens=MAX_TOKENS,
        batch_size=8,
        buffer_size=256,
        inflight=16,
        figures=figures,
    )
    for row, completion in stream:
        answered.append((row, completion.text))
        if not killed:
            pool.kill(1)  # mid-job: 4 of 12 batches sent; whatever replica 1 holds or gets next fails
            killed = True
    assert sorted(row for row, _ in answered) == list(range(len(prompts)))  # every row once: none lost, none twice
    assert [text for _, text in sorted(answered)] == reference
    assert figures.replicas[1].died and not figures.replicas[0].died
    assert figures.retried_batches >= 1 and figures.duplicates_dropped == 0
    assert figures.replicas[0].requests + figures.replicas[1].requests == len(prompts)


def test_a_ray_dataset_streams_in_and_every_row_is_answered_by_its_id(cluster):
    from kvreuse.batch import Completion
    from kvreuse.batch.table_stream import answer_table_stream

    class Upper:
        cache_model = None

        def generate(self, prompts, *, max_tokens, progress=False):
            return [Completion(p.upper(), None, None) for p in prompts]

    import pandas as pd
    import ray.data

    df = pd.DataFrame(
        {
            "rid": range(300),
            "title": [f"film {i % 7}" for i in range(300)],
            "review": [f"review {i}" for i in range(300)],
        }
    )
    dataset = ray.data.from_pandas(df).repartition(4)
    answered = dict(
        answer_table_stream(
            dataset,
            "Kids?",
            ["title", "review"],
            pool=InProcessReplicas([Upper()]),
            id_column="rid",
            rows_per_chunk=64,
            batch_size=8,
        )
    )
    assert sorted(answered) == list(range(300))
    assert all(answered[i].text == f"KIDS?\n\nTITLE: FILM {i % 7}\nREVIEW: REVIEW {i}\n" for i in range(300))
