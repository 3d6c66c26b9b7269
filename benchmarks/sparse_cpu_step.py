"""One decode step's attention on a CPU, kvreuse's sparse backend against vLLM's CPU_ATTN ops, side by side.

What ``sparse_qa.py`` measures in the engine, taken apart: for a model shaped like SmolLM2-135M (30 layers, 9 query
heads on 3 KV heads, head_dim 64, block size 32, float32), one decode token per step over a context of ``L`` tokens,
every layer writes the token's key and value and attends:

- ``stock``: vLLM's own CPU ops, as its CPU_ATTN backend calls them (``cpu_attn_reshape_and_cache``, then
  ``cpu_attention_with_kv_cache`` with the step's scheduler metadata built once per step), on vLLM's CPU cache layout
  ``[num_blocks, kv_heads, block_size, head_dim]`` per K and V;
- ``sparse beta=X``: ``SparseAttention.write`` and ``attend`` on the backend's layout of the padded pages vLLM
  allocates (``kvreuse.vllm.sparse.backend.layer_cache`` of vLLM's LBNHC view of ``[num_blocks, block_size + sketch
  rows, kv_heads, K|V]``: every block's K/V packed, then every block's key sketch), with beta ``X`` in every layer
  but the first (the default policy);
- ``filter beta=X``: the same on CPU_ATTN's layout (LBHNC), every exact attention through vLLM's op and DIPR only
  choosing each KV head's blocks (``sparse.engine_kernel``, the CPU default).

The keys are the real ones of ``tests/data/smollm2_keys.pt`` (SmolLM2's layers 4 and 20 on a 1K-token retrieval
prompt, alternated over the layers and repeated along the context), the query the last decode query of the same
layer; so the pruning is the real model's, only repeated. The two sides run alternately, step after step, in one
process; each figure is the median over steps of (sparse time / stock time), so that load from other processes
on a shared machine falls on both sides alike. ``--profile`` prints where the sparse side's time goes.
``--between-mb 14`` streams a layer's worth of weights before every layer (untimed), so that each layer's
attention starts, as in the engine, with the caches holding the model's weights rather than its own code and data:
the fixed work of a call (Python, PyTorch's dispatch, the ops' setup) then costs several times what it costs back to
back.

Run: ``.venv/bin/python benchmarks/sparse_cpu_step.py`` (``--lengths 1024,8192 --steps 20``); writes
``sparse_cpu_step.json`` (``--name``) under ``build/benchmarks/``, or ``docs/benchmarks/results/`` with
``--update-results``. ``--breakdown`` also times, per DIPR layer, the filter's decision and its pruned attention
beside stock's dense call.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, output_dir, write_results  # noqa: E402

from kvreuse.sparse.config import SparseConfig  # noqa: E402
from kvreuse.sparse.paged import PagedBatch, SparseAttention  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "data" / "smollm2_keys.pt"
LAYERS, Q_HEADS, KV_HEADS, DIM, BLOCK = 30, 9, 3, 64, 32
SKETCH_ROWS = 5  # token rows of one block's sketch (kvreuse.vllm.sparse.backend.sketch_rows for this shape)
BETAS = [float("inf"), 4.0, 2.0]


def real_kv(length: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: keys and values ``[length + 1, kv, d]`` (the last one the decoded token's) and the query
    ``[q_heads, d]``. Values are the keys of the other fixture layer (real magnitudes, uncorrelated with the key)."""
    data = torch.load(FIXTURE)
    keys, queries = data["keys"].float(), data["queries"].float()
    n = keys.shape[1]
    index = torch.arange(length + 1) % n
    out_k, out_v, out_q = [], [], []
    for layer in range(LAYERS):
        out_k.append(keys[layer % 2][index].contiguous())
        out_v.append(keys[(layer + 1) % 2][index].contiguous())
        out_q.append(queries[layer % 2][-1].contiguous())
    return out_k, out_v, out_q


class Sparse:
    """The sparse backend's side: per layer padded pages, their K/V views and sketch, as the adapter lays them out."""

    def __init__(self, keys, values, length: int, beta: float):
        from kvreuse.vllm.sparse.backend import layer_cache

        self.blocks = -(-(length + 1) // BLOCK) + 1
        self.attention = SparseAttention(
            Q_HEADS, KV_HEADS, DIM, BLOCK, DIM**-0.5, SparseConfig(beta=beta, min_context=0)
        )
        self.layers = []
        prefill = torch.arange(length, dtype=torch.int64)
        for k, v in zip(keys, values):
            pages = torch.zeros(self.blocks, BLOCK + SKETCH_ROWS, KV_HEADS, 2 * DIM)
            cache = layer_cache(pages[:, :BLOCK].transpose(1, 2))  # vLLM's [blocks, heads, tokens, K|V] view
            key_cache, value_cache, sketch = cache.key_cache, cache.value_cache, cache.sketch
            self.attention.write(k[:length], v[:length], key_cache, value_cache, sketch, prefill)
            self.layers.append((key_cache, value_cache, sketch))
        self.block_table = torch.arange(self.blocks, dtype=torch.int32)[None]

    def step(self, length: int, keys, values, queries, between: Between | None = None) -> float:
        started, outside = time.perf_counter(), 0.0
        slot = torch.tensor([length], dtype=torch.int64)
        batch = PagedBatch(
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([length + 1], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([length + 1], dtype=torch.int32),
            block_table=self.block_table,
            slot_mapping=slot,
            num_actual_tokens=1,
            max_seq_len=length + 1,
        )
        out = torch.empty(1, Q_HEADS, DIM)
        for layer, (key_cache, value_cache, sketch) in enumerate(self.layers):
            outside += between() if between else 0.0
            k, v = keys[layer][length : length + 1], values[layer][length : length + 1]
            self.attention.write(k, v, key_cache, value_cache, sketch, slot)
            self.attention.attend(layer, queries[layer][None], key_cache, value_cache, sketch, batch, out)
        return time.perf_counter() - started - outside


class Filter(Sparse):
    """The sparse backend on vLLM's CPU_ATTN layout (``KVREUSE_SPARSE_CPU_BACKEND=1`` without the module cache):
    LBHNC, the key sketches after every block's K/V, every exact attention through vLLM's op, DIPR choosing each
    KV head's blocks (``SparseAttention(paged_kernel=CPUAttentionKernel(...))``)."""

    def __init__(self, keys, values, length: int, beta: float):
        from kvreuse.vllm.sparse.backend import layer_cache
        from kvreuse.vllm.sparse.cpu_kernel import CPUAttentionKernel

        self.blocks = -(-(length + 1) // BLOCK) + 1
        kernel = CPUAttentionKernel(torch.float32, BLOCK, DIM, DIM**-0.5)
        self.attention = SparseAttention(
            Q_HEADS, KV_HEADS, DIM, BLOCK, DIM**-0.5, SparseConfig(beta=beta, min_context=0), paged_kernel=kernel
        )
        self.layers = []
        prefill = torch.arange(length, dtype=torch.int64)
        kv_elements = KV_HEADS * BLOCK * 2 * DIM
        pad = SKETCH_ROWS * KV_HEADS * 2 * DIM  # vLLM's padded page (customize_spec)
        for k, v in zip(keys, values):
            pages = torch.zeros(self.blocks, kv_elements + pad)
            cache = layer_cache(pages[:, :kv_elements].view(self.blocks, KV_HEADS, BLOCK, 2 * DIM))
            key_cache, value_cache, sketch = cache.key_cache, cache.value_cache, cache.sketch
            self.attention.write(k[:length], v[:length], key_cache, value_cache, sketch, prefill)
            self.layers.append((key_cache, value_cache, sketch))
        self.block_table = torch.arange(self.blocks, dtype=torch.int32)[None]


class Stock:
    """vLLM's CPU_ATTN side: its cache layout and ops, called as ``CPUAttentionBackendImpl`` calls them."""

    def __init__(self, keys, values, length: int):
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops = ops
        self.isa = _get_attn_isa(torch.float32, BLOCK, DIM)
        self.blocks = -(-(length + 1) // BLOCK) + 1
        self.layers = []
        prefill = torch.arange(length, dtype=torch.int64)
        for k, v in zip(keys, values):
            kv_cache = torch.zeros(self.blocks, KV_HEADS, 2 * BLOCK, DIM)
            key_cache, value_cache = kv_cache.chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k[:length], v[:length], key_cache, value_cache, prefill, self.isa)
            self.layers.append((key_cache, value_cache))
        self.block_table = torch.arange(self.blocks, dtype=torch.int32)[None]

    def step(self, length: int, keys, values, queries, between: Between | None = None) -> float:
        started, outside = time.perf_counter(), 0.0
        ops = self.ops
        slot = torch.tensor([length], dtype=torch.int64)
        starts = torch.tensor([0, 1], dtype=torch.int32)
        seq_lens = torch.tensor([length + 1], dtype=torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            1, Q_HEADS, KV_HEADS, DIM, seq_lens, torch.float32, starts, True, -1, self.isa, True
        )
        out = torch.empty(1, Q_HEADS, DIM)
        for layer, (key_cache, value_cache) in enumerate(self.layers):
            outside += between() if between else 0.0
            k, v = keys[layer][length : length + 1], values[layer][length : length + 1]
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slot, self.isa)
            ops.cpu_attention_with_kv_cache(
                queries[layer][None], key_cache, value_cache, out, starts, seq_lens, DIM**-0.5, True, None, -1,
                self.block_table, 0.0, metadata, None,
            )  # fmt: skip
        return time.perf_counter() - started - outside


def breakdown(filter_side: Filter, stock: Stock, length: int, queries, repeats: int = 5) -> dict:
    """Per DIPR layer (1-29), milliseconds of each piece of a filtered decode at its beta, beside stock's op over
    the same context: the decision (``prune_by_sketch``, one compiled call), the op over the pruned tables, and
    stock's dense call; medians over ``repeats``, summed over the layers. ``decision_hot_ms``: the decision called
    ``repeats`` times back to back, its sketch then in the CPU's caches (what it costs where memory is no limit),
    beside ``decision_ms`` with the sketch read from memory (each call after the attentions, as in a step)."""
    from kvreuse.sparse.sketch_scan import prune_by_sketch

    attention = filter_side.attention
    config = attention.config
    kernel = attention.paged_kernel
    assert kernel is not None
    lens = torch.tensor([length], dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    metadata = stock.ops.cpu_attn_get_scheduler_metadata(
        1, Q_HEADS, KV_HEADS, DIM, lens, torch.float32, starts, True, -1, stock.isa, True
    )
    sums = {"decision_ms": 0.0, "decision_hot_ms": 0.0, "pruned_attention_ms": 0.0, "stock_attention_ms": 0.0}
    for layer in range(1, LAYERS):
        key_cache, value_cache, sketch = filter_side.layers[layer]
        q = queries[layer][None]
        scaled = q.view(1, KV_HEADS, Q_HEADS // KV_HEADS, DIM) * DIM**-0.5
        times: dict[str, list[float]] = {name: [] for name in sums}
        out = torch.empty(1, Q_HEADS, DIM)

        def decide(scaled=scaled, sketch=sketch):
            return prune_by_sketch(
                scaled, sketch, filter_side.block_table, lens, config.beta, config.sink, config.local, config.top_pages
            )

        for _ in range(repeats):
            started = time.perf_counter()
            tables = decide()
            times["decision_ms"].append(time.perf_counter() - started)
            started = time.perf_counter()
            kernel.attend_pruned(q, key_cache, value_cache, out, tables)
            times["pruned_attention_ms"].append(time.perf_counter() - started)
            stock_keys, stock_values = stock.layers[layer]
            started = time.perf_counter()
            stock.ops.cpu_attention_with_kv_cache(
                q, stock_keys, stock_values, out, starts, lens, DIM**-0.5, True, None, -1, stock.block_table, 0.0,
                metadata, None,
            )  # fmt: skip
            times["stock_attention_ms"].append(time.perf_counter() - started)
        for _ in range(repeats):
            started = time.perf_counter()
            decide()
            times["decision_hot_ms"].append(time.perf_counter() - started)
        for name, values in times.items():
            sums[name] += 1e3 * statistics.median(values)
    return sums


class Between:
    """What a model computes between two layers' attention, for ``--between-mb``: a matrix-vector product over
    ``mb`` MB of fp32 weights (SmolLM2-135M streams ~14 MB per layer, its projections and MLP, and 113 MB for its
    output layer once a token), which leaves the caches holding weights, not the attention's code and data, as in
    an engine's decode step. Called, it returns its own seconds, which the step's time leaves out."""

    def __init__(self, mb: float):
        self.weights = torch.randn(max(1, int(mb * 2**20 / 4 / 1536)), 1536)
        self.x = torch.randn(1, 1536)

    def __call__(self) -> float:
        started = time.perf_counter()
        torch.nn.functional.linear(self.x, self.weights)
        return time.perf_counter() - started


def measure(
    length: int, steps: int, profile: bool, kinds: list[str], split: bool = False, between: Between | None = None
) -> dict:
    """One row: each side's step time over a context of ``length`` tokens, the decoded token's the last (at slot
    ``length - 1``: a block the step does not start, as in 31 of 32 decode steps); with ``between``, the model's
    other work run before every layer (not counted)."""
    prefilled = length - 1
    keys, values, queries = real_kv(prefilled)
    stock = Stock(keys, values, prefilled)
    sides = {"stock": stock}
    if "own" in kinds:
        sides.update({f"beta={b:g}": Sparse(keys, values, prefilled, b) for b in BETAS})
    if "filter" in kinds:
        sides.update({f"filter beta={b:g}": Filter(keys, values, prefilled, b) for b in BETAS})
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(2):  # warm-up
        for side in sides.values():
            side.step(prefilled, keys, values, queries)
    for _ in range(steps):
        for name, side in sides.items():
            times[name].append(side.step(prefilled, keys, values, queries, between))
    row = {"length": length, "stock_ms": 1e3 * statistics.median(times["stock"])}
    for name in sides:
        if name != "stock":
            row[name] = statistics.median(t / s for t, s in zip(times[name], times["stock"]))
            row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
            sparse = sides[name]
            rows = sparse.attention.figures.rows()
            read = sum(r["blocks_read"] for r in rows) / max(1, sum(r["blocks_total"] for r in rows))
            row[f"{name}_blocks"] = read
    if split:
        for name in sides:
            if name.startswith("filter") and name.split("=")[-1] != "inf":
                row[f"{name}_breakdown"] = parts = breakdown(sides[name], stock, prefilled, queries)
                print(
                    f"{length} tokens, {name}, 29 DIPR layers: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                )
    if profile:
        for name in sides:
            if name != "stock" and name.split("=")[-1] in ("inf", "4"):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        sides[name].step(prefilled, keys, values, queries)
                print(f"--- {length} tokens, {name}: 3 steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    return row


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--lengths", default="1024,8192")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time the filter's decision and pruned attention per layer beside stock's",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: PyTorch's, as the engine's worker)")
    parser.add_argument(
        "--between-mb",
        type=float,
        default=0.0,
        help="before every layer, stream this many MB of weights (as the model does between two layers; not timed)",
    )
    parser.add_argument("--name", default="sparse_cpu_step")
    parser.add_argument(
        "--sides", default="own,filter", help="sparse sides beside stock: own (kvreuse's kernels), filter (vLLM's op)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = args.sides.split(",")
    between = Between(args.between_mb) if args.between_mb else None
    rows = [measure(int(n), args.steps, args.profile, kinds, args.breakdown, between) for n in args.lengths.split(",")]
    prefixes = [prefix for kind, prefix in (("own", ""), ("filter", "filter ")) if kind in kinds]
    names = [f"{prefix}beta={b:g}" for prefix in prefixes for b in BETAS]
    print("| context | stock ms/step | " + " | ".join(f"{n} / stock (blocks read)" for n in names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for r in rows:
        cells = [f"{r[n]:.2f} ({r[n + '_blocks']:.0%})" for n in names]
        print(f"| {r['length']:,} | {r['stock_ms']:.1f} | " + " | ".join(cells) + " |")
    load = os.getloadavg()[0]
    print(f"load average (1 min) at the end: {load:.1f}")
    write_results(
        args.name, {"rows": rows, "threads": torch.get_num_threads(), "between_mb": args.between_mb}, output_dir(args)
    )


if __name__ == "__main__":
    main()
