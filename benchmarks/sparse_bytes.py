"""Bytes of K/V that DIPR decode reads, relative to dense decode, on synthetic keys with realistic structure.

No GPU needed: the blocks read are those of the kernel's PyTorch reference (``dipr_selection_reference``, which the
kernel tests hold the kernel to), for one decode step per context length, beta and block size.

Bytes counted (fp16 cache): K and V of every block read, plus the key sketch of every token (an int8 code per
channel and an fp32 scale, ``head_dim + 4`` bytes per token and KV head, ``kvreuse.kernels.key_sketch``); dense
reads K and V of every block. The ratio is per KV head, averaged over KV heads. Real keys of SmolLM2-135M are in
``benchmarks/sparse_real_keys.py`` and the retrieval benchmark ``benchmarks/sparse_qa.py``.

Synthetic keys, per KV head (``head_dim`` 128, 4 query heads per KV head as in GQA models), built so that the
logits have a chosen distribution (all figures in nats of logit):
- the context is a sequence of *rows* (a structured-data prompt) of 32-256 tokens; a row's keys share a centre
  and differ by isotropic noise that moves a token's logit by ``TOKEN_SD = 0.5``;
- each query head sees each row with a relevance drawn from N(0, ``ROW_SD = 1.5``), except 3 target rows per
  head at ``GAP = 10``; the heads of one KV head have different targets, so a block is read for their union;
- queries concentrate on 16 of the 124 regular channels (an assumption standing for the channel concentration of
  real queries); Quest's bound then exceeds a block's true maximum by ~3 nats, with all 124 channels by ~8;
- 4 outlier channels hold large, nearly constant values in every key (Liu et al., "KIVI: A Tuning-Free Asymmetric
  2bit Quantization for KV Cache", 2024, find such fixed outlier channels in keys); queries have a small
  component on them, which shifts all logits alike;
- token 0 is an attention sink (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", 2024),
  1 above each query head's best other token.
The bytes saved depend on beta relative to that spread (max - mean ~ 11): they are a property of the model's
attention, and real-model figures need a GPU run.

Run: ``.venv/bin/python -P benchmarks/sparse_bytes.py`` (~30 s on a CPU); prints a table and writes
``sparse_bytes.json`` and ``.png`` under ``build/benchmarks/`` (``--update-results``: into
``docs/benchmarks/results/``, the figures the docs cite). Columns: ``bytes`` the ratio above, ``blocks`` /
``tokens`` the fractions of blocks read and tokens attended, ``exact`` the size of the exact DIPR set, ``recov`` /
``rec.min`` the mean / least share of dense attention mass kept over query heads.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench_parser, new_figure, output_dir, write_results  # noqa: E402

from kvreuse.kernels.dipr_decode import dipr_selection_reference
from kvreuse.kernels.key_sketch import KeySketch, sketch_reference
from kvreuse.sparse.figures import recovery_ratio

CONTEXTS = [4096, 8192, 16384, 32768]
BETAS = [4.0, 6.0, 8.0, 12.0]
BLOCK_SIZES = [16, 32]
KV_HEADS, GROUP, DIM, OUTLIERS, QUERY_CHANNELS = 4, 4, 128, 4, 16
ROW_SD, TOKEN_SD, GAP, TARGETS = 1.5, 0.5, 10.0, 3  # logit units (nats)
SINK, LOCAL = 16, 64
ELEMENT_BYTES = 2  # fp16 cache


def synthetic_step(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``query[1, KV_HEADS * GROUP, DIM]`` and ``keys[n, KV_HEADS, DIM]`` (fp32) as described in the docstring."""
    g = torch.Generator().manual_seed(seed)
    scale = DIM**-0.5
    starts = [0]
    while starts[-1] < n:
        starts.append(starts[-1] + int(torch.randint(32, 257, (1,), generator=g)))
    row_of = torch.bucketize(torch.arange(n), torch.tensor(starts[1:]), right=True)
    rows = len(starts) - 1
    keys = torch.empty(n, KV_HEADS, DIM)
    query = torch.empty(KV_HEADS * GROUP, DIM)
    for h in range(KV_HEADS):
        # GROUP orthonormal query directions, each on QUERY_CHANNELS of the regular channels
        u = torch.zeros(GROUP, DIM)
        for j in range(GROUP):
            channels = OUTLIERS + torch.randperm(DIM - OUTLIERS, generator=g)[:QUERY_CHANNELS]
            u[j, channels] = torch.randn(QUERY_CHANNELS, generator=g)
        u = torch.linalg.qr(u.T)[0].T
        norm = 1.0 / scale  # |q|; only logits matter, so any norm gives the same figures
        # row content: relevance to each query head (nats) along u, plus content none of the heads looks at
        relevance = ROW_SD * torch.randn(rows, GROUP, generator=g)
        for j in range(GROUP):
            relevance[torch.randperm(rows, generator=g)[:TARGETS], j] = GAP
        content = torch.randn(rows, DIM, generator=g)
        content[:, :OUTLIERS] = 0
        content -= (content @ u.T) @ u
        centre = relevance @ u / (scale * norm) + content
        noise = TOKEN_SD / (scale * norm) * torch.randn(n, DIM, generator=g)
        noise[:, :OUTLIERS] = 0.1 * torch.randn(n, OUTLIERS, generator=g)
        k = centre[row_of] + noise
        k[:, :OUTLIERS] += 8 * torch.sign(torch.randn(OUTLIERS, generator=g))
        q = norm * u
        q[:, :OUTLIERS] = 0.5 * torch.randn(GROUP, OUTLIERS, generator=g)
        # token 0: an attention sink, 1 nat above each head's best token (the least-norm key with those logits)
        best = (q @ k[1:].T).amax(1) * scale
        k[0] = torch.linalg.pinv(q) @ ((best + 1.0) / scale)
        keys[:, h] = k
        query[h * GROUP : (h + 1) * GROUP] = q
    return query[None], keys


def measure(n: int, beta: float, block_size: int, query, keys) -> dict:
    blocks = -(-n // block_size)
    cache = torch.zeros(blocks * block_size, KV_HEADS, DIM)
    cache[:n] = keys
    cache = cache.view(blocks, block_size, KV_HEADS, DIM)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    seq_lens = torch.tensor([n], dtype=torch.int32)
    sketch = KeySketch(*sketch_reference(cache))
    sel = dipr_selection_reference(query, cache, sketch, table, seq_lens, beta, DIM**-0.5, SINK, LOCAL)
    read = sel.blocks_read[0].float().sum(1)  # per KV head
    row = DIM * ELEMENT_BYTES
    dense = 2 * n * row
    sparse = read * 2 * block_size * row + n * (DIM + 4)
    recovery = recovery_ratio(sel.logits[0], sel.attended[0])
    return {
        "context": n,
        "beta": beta,
        "block_size": block_size,
        "bytes_ratio": float((sparse / dense).mean()),
        "block_fraction": float(read.mean() / blocks),
        "token_fraction": float(sel.attended[0].float().mean()),
        "exact_token_fraction": float(sel.exact[0].float().mean()),
        "recovery_mean": float(recovery.mean()),
        "recovery_min": float(recovery.min()),
    }


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    started = time.time()
    rows = []
    for n in CONTEXTS:
        query, keys = synthetic_step(n, seed=n)
        for block_size in BLOCK_SIZES:
            for beta in BETAS:
                rows.append(measure(n, beta, block_size, query, keys))
    header = (
        f"{'context':>8} {'block':>5} {'beta':>5} {'bytes':>7} {'blocks':>7} {'tokens':>7} {'exact':>7} "
        f"{'recov':>7} {'rec.min':>7}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['context']:>8} {r['block_size']:>5} {r['beta']:>5.1f} {r['bytes_ratio']:>7.3f} "
            f"{r['block_fraction']:>7.3f} {r['token_fraction']:>7.4f} {r['exact_token_fraction']:>7.4f} "
            f"{r['recovery_mean']:>7.4f} {r['recovery_min']:>7.4f}"
        )
    setup = {
        "kv_heads": KV_HEADS,
        "q_heads_per_kv_head": GROUP,
        "head_dim": DIM,
        "outlier_channels": OUTLIERS,
        "query_channels": QUERY_CHANNELS,
        "row_relevance_sd_nats": ROW_SD,
        "token_sd_nats": TOKEN_SD,
        "target_logit_nats": GAP,
        "target_rows_per_head": TARGETS,
        "sink": SINK,
        "local": LOCAL,
        "cache_bytes_per_value": ELEMENT_BYTES,
        "measured_by": "kvreuse.kernels.dipr_decode.dipr_selection_reference",
    }
    write_results("sparse_bytes", {"setup": setup, "rows": rows}, output_dir(args), plot(rows))
    print(f"in {time.time() - started:.0f} s")


def plot(rows: list[dict]) -> Any:
    """Bytes read, DIPR over dense, against the context, one line per beta; a panel per block size."""
    fig, axes = new_figure(1, 2, figsize=(10, 4), sharey=True)
    for ax, block_size in zip(axes, BLOCK_SIZES):
        for beta in BETAS:
            pts = [r for r in rows if r["block_size"] == block_size and r["beta"] == beta]
            recovery = min(r["recovery_min"] for r in pts)
            ax.plot(
                [r["context"] for r in pts],
                [r["bytes_ratio"] for r in pts],
                marker="o",
                label=f"beta {beta:g} (recovery >= {recovery:.3f})",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(CONTEXTS, [f"{c // 1024}K" for c in CONTEXTS])
        ax.set_title(f"block size {block_size}")
        ax.set_xlabel("context tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("K/V bytes read, DIPR / dense")
    fig.suptitle("DIPR decode on synthetic structured keys (reference path)")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
