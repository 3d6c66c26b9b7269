"""Cheaper exact block decisions for DIPR, measured on real keys: blocks read against each decision's work.

DIPR's exact decision (``kvreuse.sparse.sketch_scan.prune_by_sketch``) bounds every key's logit from its int8 code
(``64`` multiply-adds per query head and token on SmolLM2), which on a CPU is about half the multiply-adds of the
dense attention it prunes. A cheaper decision must bound most blocks from less work and stay exact: no block that
holds a key within beta of the largest logit may be skipped. Candidates, each a valid upper bound on a block's best
logit ``max_j q . k_j``:

- ``sketch``: the int8 sketch's per-token bound (what the engine runs): work 1 (the reference);
- ``reuse-cs``: the previous decode step's exact block maxima, moved by how far the query moved
  (``max_j q' . k_j <= max_j q . k_j + ||q' - q||_2 max_j ||k_j||_2``, Cauchy-Schwarz): no per-token work;
- ``reuse-l1``: the same with Hoelder (``||q' - q||_1 max_j ||k_j||_inf``);
- ``top-m``: a first stage in the ``m`` channels where the query is largest, the rest bounded by Cauchy-Schwarz
  (``q_S . k_S + ||q_rest||_2 ||k_rest||_2``, with ``||k_rest||^2 = ||k||^2 - ||k_S||^2`` from a stored norm), then
  the sketch on the blocks it leaves: work ``2 m / 64`` per token (the ``m``-channel dot and ``||k_S||^2``; the
  channels are the query's, so nothing of it can be stored) plus the sketch's on the kept blocks.

For each candidate, per layer, the share of blocks outside the window it must still read (beside the oracle's: the
blocks holding a key within beta of the largest) and its work relative to the sketch scan's, at beta = 4, 32-token
blocks, over the fixture's consecutive decode queries (``tests/data/smollm2_keys.pt``: SmolLM2-135M's layers 4 and
20 on a 1K-token needle prompt). Bounds are taken on the exact keys (a lower bound of each candidate's reads: its
codes would only widen them).

Run: ``.venv/bin/python -P benchmarks/sparse_decisions.py --update-results`` (writes
``docs/benchmarks/results/sparse_decisions.json``; without the option, under ``build/benchmarks/``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, output_dir, write_results  # noqa: E402

FIXTURE = REPO / "tests" / "data" / "smollm2_keys.pt"
BLOCK, BETA, SINK, LOCAL = 32, 4.0, 16, 64


def block_max(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """``x[..., n]`` -> its maximum per block of ``BLOCK`` tokens ``[..., blocks]`` (padding: -inf)."""
    pad = blocks * BLOCK - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pad), value=-torch.inf).unflatten(-1, (blocks, BLOCK)).amax(-1)


def measure(data: dict) -> list[dict]:
    from kvreuse.kernels.key_sketch import logit_bounds_reference, sketch_reference

    rows = []
    scale = data["scale"]
    for li, layer in enumerate(data["layers"]):
        shares: dict[str, list[float]] = {}
        for step in range(1, len(data["query_positions"])):
            n = int(data["query_positions"][step]) + 1
            keys = data["keys"][li][:n].double()  # [n, kv, d]
            blocks = -(-n // BLOCK)
            window = torch.zeros(blocks, dtype=torch.bool)
            window[: -(-SINK // BLOCK)] = True
            window[(n - LOCAL) // BLOCK :] = True
            for h in range(keys.shape[1]):
                k = keys[:, h]
                q = data["queries"][li][step].double().view(keys.shape[1], -1, k.shape[1])[h] * scale
                q0 = data["queries"][li][step - 1].double().view(keys.shape[1], -1, k.shape[1])[h] * scale
                logits = q @ k.T  # [g, n]
                tau = logits.amax(-1, keepdim=True) - BETA
                need = (block_max(logits, blocks) >= tau).any(0)
                codes, scales = sketch_reference(k.float())
                upper, _ = logit_bounds_reference(q.float(), codes, scales)
                sketch = (block_max(upper.double(), blocks) >= tau).any(0)
                moved = q - q0
                previous = block_max(q0 @ k.T, blocks)
                cs = previous + moved.norm(dim=-1, keepdim=True) * block_max(k.norm(dim=-1), blocks)
                l1 = previous + moved.abs().sum(-1, keepdim=True) * block_max(k.abs().amax(-1), blocks)
                found = {
                    "oracle": need,
                    "sketch": sketch,
                    "reuse-cs": (cs >= tau).any(0),
                    "reuse-l1": (l1 >= tau).any(0),
                }
                for m in (8, 16, 32):
                    bound = torch.empty_like(logits)
                    for g in range(q.shape[0]):
                        top = q[g].abs().topk(m).indices
                        rest = torch.ones(k.shape[1], dtype=torch.bool)
                        rest[top] = False
                        bound[g] = q[g, top] @ k[:, top].T + q[g, rest].norm() * k[:, rest].norm(dim=-1)
                    first = (block_max(bound, blocks) >= tau).any(0)
                    found[f"top-{m}"] = first & sketch  # the sketch then decides the blocks the first stage keeps
                    found[f"top-{m} first stage"] = first
                outside = ~window
                for name, read in found.items():
                    shares.setdefault(name, []).append(float((read & outside).sum() / outside.sum()))
        first_stage = {m: statistics.mean(shares[f"top-{m} first stage"]) for m in (8, 16, 32)}
        work = {"oracle": None, "sketch": 1.0, "reuse-cs": 0.0, "reuse-l1": 0.0}
        work |= {f"top-{m}": 2 * m / 64 + first_stage[m] for m in (8, 16, 32)}
        for name, values in shares.items():
            if name.endswith("first stage"):
                continue
            rows.append({"layer": layer, "decision": name, "blocks_read": statistics.mean(values), "work": work[name]})
    return rows


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    rows = measure(torch.load(FIXTURE))
    print("| layer | decision | blocks read outside the window (beta 4) | work / the sketch scan's |")
    print("|---:|---|---:|---:|")
    for r in rows:
        work = "-" if r["work"] is None else f"{r['work']:.2f}"
        print(f"| {r['layer']} | {r['decision']} | {r['blocks_read']:.1%} | {work} |")
    write_results("sparse_decisions", {"beta": BETA, "block": BLOCK, "rows": rows}, output_dir(args))


if __name__ == "__main__":
    main()
