"""DIPR decode against dense decode on a GPU: time, bytes read, and the memory-bandwidth floor.

Two key sets. *Real keys*: the keys and decode queries of SmolLM2-135M (``tests/data/smollm2_keys.pt``, written
by ``sparse_real_keys.py --fixture``: layers 4 and 20 on a 1K-token retrieval prompt, 3 KV heads x 3 query heads,
``head_dim`` 64), at their own length and tiled to longer contexts (the tiles repeat the prompt, so each copy holds
the needle again: the fraction of blocks read stays that of the real prompt). *Synthetic keys*: the structured keys of
``sparse_bytes.py`` (rows sharing a centre, outlier channels, an attention sink; ``head_dim`` 128, 4 KV heads x 4
query heads) for contexts of 4K-128K tokens and batches of 1-64 sequences. Both fp16, each sequence in its own
paged blocks (vLLM's layout, block size 16). Arms:

- ``dense``: FlashAttention through PyTorch (``scaled_dot_product_attention`` with GQA) on contiguous K/V, which
  favours dense (no paging);
- ``dense paged``: ``kvreuse.kernels.paged_causal.PagedCausalAttention``, the sparse backend's own dense path, on
  the same pages as DIPR;
- ``dipr beta=B``: ``kvreuse.kernels.dipr_decode.DIPRDecode`` with the keys' sketch, for each beta; ``beta=inf``
  is its dense case (split-K over every block, no sketch read);
- ``flash paged``: FlashAttention's own paged decode over the same pages (vLLM's ``vllm_flash_attn`` through
  ``kvreuse.patches.vllm_0_32.flash_attention`` where vLLM's CUDA build is installed, else the ``flash_attn``
  package's ``flash_attn_varlen_func``): what a stock GPU engine runs;
- ``filter+flash beta=B``: DIPR as a filter in front of it (``kvreuse.sparse.filtered_decode.FilteredDecode``: the
  Triton sketch scan, the pruned (sequence, KV head) tables, one FlashAttention call), what the sparse backend runs
  for DIPR decodes on a GPU engine;
- ``filter only beta=B``: the same without the FlashAttention call (the scan and the tables: the filter's own cost).

Where no FlashAttention is importable (a GPU machine without vLLM or ``flash_attn``), the ``flash`` arms are left
out, said so in the output, dense decode is timed by ``scaled_dot_product_attention`` (the ``dense`` arm) only, and
the goals are judged from ``filter only`` against it, as bounds (``goals``).

A second table times prefill, which the backend keeps dense: one request of 4K-32K new tokens through
``PagedCausalAttention`` against FlashAttention's causal prefill (``scaled_dot_product_attention(is_causal=True)``)
on contiguous K/V.

Reported per arm: median time of 20 calls (CUDA events, after 3 warm-ups) as called from Python (``time``: the
host's launch work counts whenever it outlasts the GPU's, as in an engine running attention eagerly) and replayed
from a CUDA graph (``graph``: the GPU's own time), the fraction of blocks read (the kernel's own counters), bytes
read (K and V of the blocks read, and for a finite beta the sketch of every token: ``head_dim + 4`` bytes per token
and KV head), and the graphed time over the floor = those bytes / the device's measured copy bandwidth. The issue's
targets (issue 28), printed at the end: ``filter+flash`` within 1.5x of ``flash paged``'s time at ~1K tokens, and
at 32K+ tokens with at most 10% of the blocks read at least 3x faster than it.

Run on a GPU: ``.venv/bin/python benchmarks/sparse_decode_gpu.py`` (writes ``sparse_decode_gpu.json`` and ``.png``
under ``build/benchmarks/``; ``--update-results``: into ``docs/benchmarks/results/``, the figures the docs cite).
``--smoke`` runs tiny sizes on the CPU in Triton's interpreter to check the script itself (``sparse_decode_smoke.json``
and ``.png``); its times mean nothing.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv  # read before the arguments are parsed: Triton's mode is chosen at its import
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, new_figure, output_dir, write_results  # noqa: E402
from sparse_bytes import DIM, GROUP, KV_HEADS, LOCAL, SINK, synthetic_step  # noqa: E402

from kvreuse.kernels.dipr_decode import DIPRDecode  # noqa: E402
from kvreuse.kernels.key_sketch import KeySketch, sketch_reference  # noqa: E402
from kvreuse.kernels.paged_causal import PagedCausalAttention  # noqa: E402
from kvreuse.sparse.filtered_decode import FilteredDecode, PagedDecodeKernel  # noqa: E402

REAL_KEYS = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_keys.pt"
REAL_TILES = [1] if SMOKE else [1, 4, 16, 64]  # the real prompt, and copies of it end to end
BLOCK = 16
CONTEXTS = [256] if SMOKE else [4096, 16384, 32768, 65536, 131072]
BATCHES = [1, 2] if SMOKE else [1, 8, 64]
BETAS = [4.0] if SMOKE else [2.0, 4.0, 6.0]
PREFILLS = [64] if SMOKE else [4096, 16384, 32768]
WARMUPS = 1 if SMOKE else 3
MAX_TOKENS = 1 << 20 if SMOKE else 8 << 20  # K/V of at most this many tokens in memory (8M tokens ~ 16 GiB fp16)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``WARMUPS`` warm-ups (CUDA events on a GPU), as called
    from Python: the host's launch work is in the time whenever it outlasts the GPU's."""
    for _ in range(WARMUPS):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def graph_timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` replayed from a CUDA graph: the GPU's own time, without Python's launch work (as
    in an engine that captures decode in a graph). On the CPU (``--smoke``), ``timed``."""
    if device.type != "cuda":
        return timed(fn, device, repeats)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUPS):  # warm-up off the capture: compilation and the allocator's first blocks
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:  # an arm that cannot be captured is reported, not fatal to the other arms
        print(f"not captured in a CUDA graph ({error}); its graphed time is NaN")
        return float("nan")
    return timed(graph.replay, device, repeats)


def flash_attention() -> tuple[PagedDecodeKernel | None, str]:
    """FlashAttention's paged varlen call with ``PagedDecodeKernel``'s arguments, and which one it is: vLLM's own
    (through kvreuse's boundary) where vLLM's CUDA build is installed, else the ``flash_attn`` package's; (None,
    why) where neither imports or runs a 16-token-page decode here."""
    if not torch.cuda.is_available() or SMOKE:
        return None, "no GPU"
    try:
        import vllm.vllm_flash_attn  # noqa: F401

        from kvreuse.patches import vllm_0_32

        return vllm_0_32.flash_attention, "vLLM's vllm_flash_attn"
    except ImportError as error:
        why = f"vLLM's FlashAttention: {error}"
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as error:
        return None, f"{why}; flash_attn: {error}"

    def package_flash(query, key_cache, value_cache, out, cu_seqlens_q, seqused_k, max_q, max_k, block_table, scale):
        # flash_attn 2 takes paged lengths as cumulative sums and writes a new tensor (no out=): both are part of
        # what this arm costs
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
        out.copy_(
            flash_attn_varlen_func(
                query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_k, max_q, max_k, softmax_scale=scale,
                causal=True, block_table=block_table,
            )
        )  # fmt: skip

    try:  # flash_attn 2 wants pages of 256 tokens; its versions differ in the arguments they take
        q = torch.zeros(1, 1, 64, dtype=torch.float16, device="cuda")
        cache = torch.zeros(1, BLOCK, 1, 64, dtype=torch.float16, device="cuda")
        ones = torch.ones(1, dtype=torch.int32, device="cuda")
        starts = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        package_flash(q, cache, cache, q.clone(), starts, ones, 1, 1, ones[:, None] - 1, 1.0)
    except (RuntimeError, TypeError) as error:
        return None, f"{why}; flash_attn cannot run {BLOCK}-token pages here: {error}"
    return package_flash, "the flash_attn package"


FLASH, FLASH_SOURCE = flash_attention()


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device copy (read + write), the practical floor for a memory-bound kernel."""
    src = torch.empty(1 << 28 if device.type == "cuda" else 1 << 22, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, 10)


def paged(x: torch.Tensor, block: int, batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``x[n, kv_heads, dim]`` in paged blocks, repeated for ``batch`` sequences (distinct memory per sequence)."""
    n, heads, dim = x.shape
    blocks = -(-n // block)
    x = torch.cat([x, x.new_zeros(blocks * block - n, heads, dim)]).to(device=device, dtype=dtype)
    return x.view(blocks, block, heads, dim).repeat(batch, 1, 1, 1)


def paged_batch(context: int, batch: int, device: torch.device, dtype: torch.dtype):
    """Query, paged K/V caches (one run of blocks per sequence), block table, lengths, and contiguous K/V."""
    query, keys = synthetic_step(context, seed=context)
    values = torch.randn(context, KV_HEADS, DIM, generator=torch.Generator().manual_seed(1))
    key_cache, value_cache = (paged(x, BLOCK, batch, device, dtype) for x in (keys, values))
    blocks_per_seq = key_cache.shape[0] // batch
    table = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = query.expand(batch, -1, -1).to(device=device, dtype=dtype).contiguous()
    k = keys.to(device=device, dtype=dtype).transpose(0, 1).expand(batch, -1, -1, -1).contiguous()
    v = values.to(device=device, dtype=dtype).transpose(0, 1).expand(batch, -1, -1, -1).contiguous()
    return q, key_cache, value_cache, table, seq_lens, k, v


def decode_rows(
    label: str, q, key_cache, value_cache, table, seq_lens, k, v, device, dtype, repeats, bandwidth, sink, local
) -> list[dict]:
    """The dense, dense paged and DIPR arms on one batch (``q[batch, q_heads, dim]``, paged caches, and the
    contiguous ``k``/``v[batch, kv_heads, n, dim]`` FlashAttention reads), each timed as called (``seconds``) and
    replayed from a CUDA graph (``graph_seconds``)."""
    batch, q_heads, dim = q.shape
    kv_heads, context = k.shape[1], k.shape[2]
    element = torch.finfo(dtype).bits // 8
    sketch = KeySketch(*sketch_reference(key_cache))
    dense_bytes = 2 * batch * context * kv_heads * dim * element
    common = dict(keys=label, context=context, batch=batch)
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q[:, :, None], k, v, enable_gqa=True)
    paged_dense = PagedCausalAttention(q_heads, kv_heads, dim, BLOCK)
    starts = torch.arange(batch, dtype=torch.int32, device=device)
    paged_dense.plan(starts, starts + 1, seq_lens, table, 1)
    decode = DIPRDecode(q_heads, kv_heads, dim, BLOCK, sink=sink, local=local)
    decode.plan(seq_lens, table, max_seq_len=context)
    arms = [
        ("dense", sdpa, 1.0, dense_bytes),
        ("dense paged", partial(paged_dense.run, q, key_cache, value_cache), 1.0, dense_bytes),
    ]
    for beta in [float("inf"), *BETAS]:
        _, counters = decode.run(q, key_cache, value_cache, sketch, beta, return_counters=True)
        read = int(counters.blocks_read.sum())  # (sequence, KV head) blocks whose K and V were loaded
        total = int(counters.blocks_total.sum()) * kv_heads
        sketch_bytes = 0 if beta == float("inf") else batch * context * kv_heads * (dim + 4)  # codes and scale
        dipr_bytes = 2 * read * BLOCK * dim * element + sketch_bytes
        run = partial(decode.run, q, key_cache, value_cache, sketch, beta)
        arms.append((f"dipr beta={beta:g}", run, read / total, dipr_bytes))
    arms += filter_arms(q, key_cache, value_cache, sketch, table, seq_lens, context, element, sink, local)
    rows = []
    for arm, fn, blocks_read, read_bytes in arms:
        rows.append(
            dict(
                common,
                arm=arm,
                seconds=timed(fn, device, repeats),
                graph_seconds=graph_timed(fn, device, repeats),
                blocks_read=blocks_read,
                bytes=read_bytes,
                floor_s=read_bytes / bandwidth,
            )
        )
    for row in rows:
        row["speedup_vs_dense"] = rows[0]["seconds"] / row["seconds"]
        row["graph_speedup_vs_dense"] = rows[0]["graph_seconds"] / row["graph_seconds"]
    return rows


def filter_arms(q, key_cache, value_cache, sketch, table, seq_lens, context, element, sink, local) -> list[tuple]:
    """The ``flash paged``, ``filter+flash`` and ``filter only`` arms (see the module docstring): (name, call,
    fraction of blocks read, bytes read)."""
    batch, q_heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    total = batch * -(-context // BLOCK) * kv_heads
    dense_bytes = 2 * batch * context * kv_heads * dim * element
    scale = dim**-0.5
    arms = []
    out = torch.empty_like(q)
    if FLASH is not None:
        starts = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        flash = partial(FLASH, q, key_cache, value_cache, out, starts, seq_lens, 1, context, table, scale)
        arms.append(("flash paged", flash, 1.0, dense_bytes))
    for beta in BETAS:
        kernels = [("filter only", lambda *args: None)] + ([("filter+flash", FLASH)] if FLASH is not None else [])
        for name, kernel in kernels:
            decode = FilteredDecode(
                q_heads, kv_heads, dim, BLOCK, scale, max_seqs=batch, max_blocks=table.shape[1], kernel=kernel
            )
            run = partial(
                decode.run, q, key_cache, value_cache, sketch, seq_lens, table, context, beta, sink, local, out
            )
            read = int(run().blocks_read.sum())
            sketch_bytes = batch * context * kv_heads * (dim + 4)
            read_bytes = sketch_bytes + (2 * read * BLOCK * dim * element if kernel is FLASH else 0)
            arms.append((f"{name} beta={beta:g}", run, read / total, read_bytes))
    return arms


def goals(rows: list[dict]) -> list[str]:
    """Issue 28's GPU goals, one line per case: ``filter+flash`` against ``flash paged`` where FlashAttention ran.
    Without it, ``filter only`` against ``dense`` (PyTorch's SDPA on contiguous K/V, FlashAttention's own kernel for
    fp16 on CUDA): the filter's cost alone, FlashAttention's call over the blocks read untimed, so a goal can only be
    found not met (the filter alone already too slow) or left undecided."""
    lines = []
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_case.setdefault((r["keys"], r["context"], r["batch"]), {})[r["arm"]] = r
    for (keys, context, batch), arms in by_case.items():
        flash = arms.get("flash paged")
        base, prefix, against = (flash, "filter+flash", "flash") if flash else (arms["dense"], "filter only", "SDPA")
        for arm, r in arms.items():
            if not arm.startswith(prefix):
                continue
            ratio, graphed = r["seconds"] / base["seconds"], r["graph_seconds"] / base["graph_seconds"]
            if context <= 2048:
                met = ratio <= 1.5
                goal = f"within 1.5x of {against} at ~1K: {ratio:.2f}x its time (graphed {graphed:.2f}x)"
            elif context >= 32768 and r["blocks_read"] <= 0.10:
                met = ratio <= 1 / 3
                goal = f"3x faster than {against} at 32K+, <= 10% read: {1 / ratio:.2f}x (graphed {1 / graphed:.2f}x)"
            else:
                continue
            verdict = ("met" if met else "not met") if flash else ("undecided, a bound" if met else "not met, a bound")
            lines.append(
                f"{keys} {context} tokens x{batch}, {arm} ({r['blocks_read']:.1%} of blocks): {goal}, {verdict}"
            )
    return lines


def real_batches(device: torch.device, dtype: torch.dtype):
    """The real-key fixture, per layer and tiling: (label, q, caches, table, lens, k, v) for one sequence."""
    data = torch.load(REAL_KEYS)
    for i, layer in enumerate(data["layers"]):
        keys = data["keys"][i].float()  # [n, kv_heads, dim]
        query = data["queries"][i][-1:].float()  # the last decode step's query, [1, q_heads, dim]
        for tiles in REAL_TILES:
            tiled = keys.repeat(tiles, 1, 1)
            values = torch.randn(tiled.shape, generator=torch.Generator().manual_seed(tiles))
            key_cache, value_cache = (paged(x, BLOCK, 1, device, dtype) for x in (tiled, values))
            table = torch.arange(key_cache.shape[0], dtype=torch.int32, device=device)[None]
            seq_lens = torch.tensor([len(tiled)], dtype=torch.int32, device=device)
            k, v = (x.to(device=device, dtype=dtype).transpose(0, 1)[None].contiguous() for x in (tiled, values))
            yield (
                f"real L{layer} x{tiles}",
                query.to(device=device, dtype=dtype),
                key_cache,
                value_cache,
                table,
                seq_lens,
                k,
                v,
            )


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU in Triton's interpreter: checks the script only"
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not SMOKE else "cpu")  # --smoke: the CPU, always
    if device.type != "cuda" and not SMOKE:
        sys.exit("no GPU: run with --smoke to check the script in Triton's interpreter")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    bandwidth = copy_bandwidth(device)
    repeats = 1 if SMOKE else 20
    rows = []
    for label, *batch in real_batches(device, dtype):
        rows += decode_rows(label, *batch, device, dtype, repeats, bandwidth, SINK, LOCAL)
    for context in CONTEXTS:
        for batch in BATCHES:
            if context * batch > MAX_TOKENS:
                continue
            rows += decode_rows(
                "synthetic", *paged_batch(context, batch, device, dtype), device, dtype, repeats, bandwidth, SINK, LOCAL
            )
    print(
        f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (smoke)'}, "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    )
    print(
        f"{'keys':>14} {'context':>8} {'batch':>5} {'arm':>20} {'time us':>9} {'graph us':>9} {'blocks':>7} "
        f"{'MB read':>9} {'x floor':>8} {'vs dense':>9} {'graphed':>8}"
    )
    for r in rows:
        print(
            f"{r['keys']:>14} {r['context']:>8} {r['batch']:>5} {r['arm']:>20} {r['seconds'] * 1e6:>9.1f} "
            f"{r['graph_seconds'] * 1e6:>9.1f} {r['blocks_read']:>7.1%} {r['bytes'] / 1e6:>9.1f} "
            f"{r['graph_seconds'] / r['floor_s']:>8.2f} {r['speedup_vs_dense']:>8.2f}x "
            f"{r['graph_speedup_vs_dense']:>7.2f}x"
        )
    print(f"FlashAttention: {FLASH_SOURCE if FLASH is not None else 'none, ' + FLASH_SOURCE}")
    if FLASH is None:
        print("  the flash arms are left out: dense decode is timed by torch's scaled_dot_product_attention only")
    for line in goals(rows):
        print(f"  goal: {line}")
    prefills = prefill_rows(device, dtype, repeats)
    print(f"\n{'prefill':>8} {'arm':>22} {'time ms':>9} {'vs flash':>9} {'max |diff|':>11}")
    for r in prefills:
        print(
            f"{r['tokens']:>8} {r['arm']:>22} {r['seconds'] * 1e3:>9.2f} {r['speedup_vs_flash']:>8.2f}x "
            f"{r.get('max_abs_diff_vs_flash', 0.0):>11.2e}"
        )
    write_results(
        "sparse_decode_smoke" if SMOKE else "sparse_decode_gpu",
        {"decode": rows, "prefill": prefills, "flash": FLASH_SOURCE, "goals": goals(rows)},
        output_dir(args),
        plot([r for r in rows if r["keys"] == "synthetic"]),
    )


def prefill_rows(device: torch.device, dtype: torch.dtype, repeats: int) -> list[dict]:
    """One request of ``n`` new tokens (no cached context): the paged kernel against FlashAttention's causal prefill."""
    rows = []
    for n in PREFILLS:
        g = torch.Generator().manual_seed(n)
        q, k, v = (
            torch.randn(n, heads, DIM, generator=g).to(device=device, dtype=dtype)
            for heads in (KV_HEADS * GROUP, KV_HEADS, KV_HEADS)
        )
        blocks = -(-n // BLOCK)
        key_cache, value_cache = (
            torch.cat([x, x.new_zeros(blocks * BLOCK - n, KV_HEADS, DIM)]).view(blocks, BLOCK, KV_HEADS, DIM)
            for x in (k, v)
        )
        table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
        lens = torch.tensor([n], dtype=torch.int32, device=device)
        paged = PagedCausalAttention(KV_HEADS * GROUP, KV_HEADS, DIM, BLOCK)
        paged.plan(lens - n, lens, lens, table, n)
        heads_first = [x.transpose(0, 1)[None] for x in (q, k, v)]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        flash_s = timed(partial(sdpa, *heads_first, is_causal=True, enable_gqa=True), device, repeats)
        paged_s = timed(partial(paged.run, q, key_cache, value_cache), device, repeats)
        flash_out = torch.nn.functional.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True)
        error = float((paged.run(q, key_cache, value_cache) - flash_out[0].transpose(0, 1)).abs().max())
        rows.append(dict(tokens=n, arm="flash (contiguous)", seconds=flash_s, speedup_vs_flash=1.0))
        rows.append(
            dict(
                tokens=n,
                arm="dense paged (kvreuse)",
                seconds=paged_s,
                speedup_vs_flash=flash_s / paged_s,
                max_abs_diff_vs_flash=error,
            )
        )
    return rows


def plot(rows: list[dict]) -> Any:
    """Graphed speed-up over dense decode against context, one panel per batch size, a line per arm."""
    batches = sorted({r["batch"] for r in rows})
    fig, axes = new_figure(1, len(batches), figsize=(4 * len(batches), 3.6), squeeze=False, sharey=True)
    for ax, batch in zip(axes[0], batches):
        for arm in dict.fromkeys(r["arm"] for r in rows if r["arm"] != "dense"):  # dense paged and each beta
            points = [
                (r["context"], r["graph_speedup_vs_dense"]) for r in rows if r["batch"] == batch and r["arm"] == arm
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(3.0, color="grey", linestyle="--", label="target 3x")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("speed-up over dense decode (CUDA graph)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
