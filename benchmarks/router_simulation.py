"""Routing at cluster scale, simulated: random, round-robin, least-loaded and prefix-aware routers compared.

No engine runs. The workload is shaped like Daft's prefix-bucketing study: ``--prompts`` prompts, each made of
one of ``--prefixes`` shared prefixes (``--prefix-blocks`` KV blocks, half the prompt) followed by as many
blocks unique to the prompt. Prompts arrive shuffled, go through the streaming prefix bucketing
(``kvreuse.reorder.bucket_stream``) and are cut into batches of ``--batch`` requests; each batch is routed by
the router under test (:mod:`kvreuse.reorder.routing`).

Replica model (one object per replica): an LRU prefix cache of ``--cache-blocks`` blocks, looked up and filled
when a batch arrives (a prompt's hit is the run of its leading blocks found in the cache); a FIFO queue of work,
where a request costs its uncached blocks plus ``--decode-cost``; a speed in work units per tick drawn from
[0.75, 1.25] x ``--speed`` (replicas are not all equally fast). The dispatcher keeps at most ``--inflight``
unfinished requests per replica in the cluster, as an actor pool with back-pressure would; routers see each
replica's unfinished requests, as in the real job.

Reported per router: block hit rate, requests per replica (max / mean and coefficient of variation) and the
makespan in ticks (the time the slowest replica finishes; lower is better).

    python benchmarks/router_simulation.py            # 50,000 prompts, 256 replicas: < 1 min
    python benchmarks/router_simulation.py --full     # 200,000 prompts, 2,048 replicas
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any

from harness import bench_parser, new_figure, output_dir, write_results

from kvreuse.reorder import bucket_stream
from kvreuse.reorder.bucketing import common_prefix_length
from kvreuse.reorder.routing import ROUTERS, make_router


@dataclass(frozen=True)
class Workload:
    prompts: int
    prefixes: int
    prefix_blocks: int
    replicas: int
    cache_blocks: int
    batch: int
    inflight: int
    speed: float
    decode_cost: int
    buffer: int
    slack: int
    seed: int


@dataclass
class RouterFigures:
    router: str
    hit_rate: float
    requests_max_over_mean: float
    requests_cv: float
    makespan_ticks: int
    route_s: float


class Replica:
    """One engine replica: an LRU block cache, a FIFO queue of request costs, a speed."""

    def __init__(self, capacity: int, speed: float) -> None:
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.capacity = capacity
        self.speed = speed
        self.queue: deque[float] = deque()
        self.requests = 0

    def admit(self, blocks: tuple[int, ...], decode_cost: int) -> int:
        """Look the prompt up (leading blocks only), cache its blocks, queue its work; the blocks hit."""
        hit = 0
        while hit < len(blocks) and blocks[hit] in self.cache:
            hit += 1
        for block in blocks:
            self.cache[block] = None
            self.cache.move_to_end(block)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        self.queue.append(len(blocks) - hit + decode_cost)
        self.requests += 1
        return hit

    def work(self) -> int:
        """Spend one tick of work; the number of requests finished."""
        budget, done = self.speed, 0
        while self.queue and budget > 0:
            if self.queue[0] <= budget:
                budget -= self.queue.popleft()
                done += 1
            else:
                self.queue[0] -= budget
                budget = 0
        return done


def make_prompts(w: Workload) -> list[tuple[int, ...]]:
    """Each prompt as block ids: its prefix's blocks, then blocks of its own. Shuffled arrival order."""
    rng = random.Random(w.seed)
    unique = w.prefixes * w.prefix_blocks
    prompts = []
    for i in range(w.prompts):
        p = rng.randrange(w.prefixes)
        own = range(unique + i * w.prefix_blocks, unique + (i + 1) * w.prefix_blocks)
        prompts.append(tuple(range(p * w.prefix_blocks, (p + 1) * w.prefix_blocks)) + tuple(own))
    return prompts


def batches(w: Workload, prompts: list[tuple[int, ...]]):
    for bucket in bucket_stream(prompts, lambda p: p, buffer_size=w.buffer, min_bucket=w.batch):
        for start in range(0, len(bucket), w.batch):
            yield bucket[start : start + w.batch]


def simulate(router_name: str, w: Workload, prompts: list[tuple[int, ...]]) -> RouterFigures:
    rng = random.Random(w.seed + 1)
    replicas = [Replica(w.cache_blocks, w.speed * rng.uniform(0.75, 1.25)) for _ in range(w.replicas)]
    options = {"slack": w.slack, "recent_keys": w.cache_blocks} if router_name == "prefix-aware" else {}
    if router_name == "random":
        options = {"seed": w.seed}
    router = make_router(router_name, w.replicas, **options)
    stream = batches(w, prompts)
    pending = next(stream, None)
    hits = blocks = unfinished = ticks = 0
    route_s = 0.0
    cap = w.inflight * w.replicas
    while pending is not None or unfinished:
        while pending is not None and unfinished + len(pending) <= cap:
            t0 = time.perf_counter()
            # The batch's shared leading blocks are its prefix keys (block ids here are already chained).
            r = router.route(pending[0][: common_prefix_length(pending[0], pending[-1])], len(pending))
            route_s += time.perf_counter() - t0
            for p in pending:
                hits += replicas[r].admit(p, w.decode_cost)
                blocks += len(p)
            unfinished += len(pending)
            pending = next(stream, None)
        ticks += 1
        for i, replica in enumerate(replicas):
            if replica.queue:
                done = replica.work()
                if done:
                    router.finish(i, done)
                    unfinished -= done
    counts = [r.requests for r in replicas]
    mean = statistics.fmean(counts)
    return RouterFigures(
        router_name, hits / blocks, max(counts) / mean, statistics.pstdev(counts) / mean, ticks, route_s
    )


def format_table(figures: list[RouterFigures]) -> str:
    base = next(f for f in figures if f.router == "round-robin")
    rows = [("router", "hit rate", "req max/mean", "req CV", "makespan ticks", "vs round-robin", "route s")]
    rows += [
        (
            f.router,
            f"{f.hit_rate:.1%}",
            f"{f.requests_max_over_mean:.2f}",
            f"{f.requests_cv:.3f}",
            f"{f.makespan_ticks:,}",
            f"{base.makespan_ticks / f.makespan_ticks:.2f}x",
            f"{f.route_s:.2f}",
        )
        for f in figures
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plot(figures: list[RouterFigures], w: Workload) -> Any:
    names = [f.router for f in figures]
    fig, axes = new_figure(1, 3, figsize=(12, 3.6))
    for ax, values, title in zip(
        axes,
        ([f.hit_rate * 100 for f in figures], [f.requests_cv for f in figures], [f.makespan_ticks for f in figures]),
        ("block hit rate, %", "requests per replica, CV", "makespan, ticks"),
    ):
        ax.bar(names, values, color=["#999", "#999", "#69c", "#c63"])
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(
        f"{w.prompts:,} prompts, {w.prefixes} prefixes, {w.replicas:,} replicas ({w.cache_blocks} cache blocks each)"
    )
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> list[RouterFigures]:
    parser = bench_parser(__doc__)
    parser.add_argument("--full", action="store_true", help="200,000 prompts on 2,048 replicas")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--prefixes", type=int, default=512)
    parser.add_argument("--prefix-blocks", type=int, default=8, help="blocks per prefix = half of each prompt")
    parser.add_argument("--cache-blocks", type=int, default=128, help="LRU capacity of each replica, in blocks")
    parser.add_argument("--batch", type=int, default=4, help="requests per routed batch")
    parser.add_argument("--inflight", type=int, default=32, help="unfinished requests per replica, cluster-wide cap")
    parser.add_argument("--speed", type=float, default=40.0, help="mean work units per replica per tick")
    parser.add_argument("--decode-cost", type=int, default=4, help="work units of a request beyond its prefill")
    parser.add_argument("--buffer", type=int, default=1024, help="bucket_stream buffer size")
    parser.add_argument("--slack", type=int, default=16, help="prefix-aware: load slack, in requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default=None, help="results file name (default router_simulation[_full])")
    args = parser.parse_args(argv)
    w = Workload(
        prompts=args.prompts or (200_000 if args.full else 50_000),
        prefixes=args.prefixes,
        prefix_blocks=args.prefix_blocks,
        replicas=args.replicas or (2048 if args.full else 256),
        cache_blocks=args.cache_blocks,
        batch=args.batch,
        inflight=args.inflight,
        speed=args.speed,
        decode_cost=args.decode_cost,
        buffer=args.buffer,
        slack=args.slack,
        seed=args.seed,
    )
    name = args.name or ("router_simulation_full" if args.full else "router_simulation")
    prompts = make_prompts(w)
    figures = []
    for router in ROUTERS:
        t0 = time.perf_counter()
        figures.append(simulate(router, w, prompts))
        print(f"  {router}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(
        f"{w.prompts:,} prompts, {w.prefixes} prefixes ({w.prefix_blocks} of {2 * w.prefix_blocks} blocks), "
        f"{w.replicas:,} replicas, {w.cache_blocks} cache blocks each, batches of {w.batch}"
    )
    print(format_table(figures))
    payload = {"workload": asdict(w), "routers": [asdict(f) for f in figures]}
    write_results(name, payload, output_dir(args), plot(figures, w))
    return figures


if __name__ == "__main__":
    main()
