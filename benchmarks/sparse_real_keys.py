"""Why per-block key bounds are loose on a real model, measured: real keys and decode queries of SmolLM2-135M.

Step 1 (``dump``): the model (``build/models/smollm2``, in Transformers, float32, as vLLM computes it) reads a
retrieval prompt of ``retrieval_cases.py`` followed by its own 16 greedy answer tokens; hooks on every attention
layer keep the keys after RoPE (what the cache holds), the keys before RoPE, and the queries of the answer
tokens (the decode queries: each attends the keys up to its own position). Saved to ``build/real_keys/``.

Step 2 (``analyse``): for each decode query, layer and KV head, DIPR's threshold ``tau = s - beta`` (``s`` = the
best logit over the window of the first ``sink`` and last ``local`` tokens) and, per block of the context outside
the window, whether the block must be read (its true best logit reaches ``tau`` for a query head of the group:
the oracle) and whether each bound says it may (then it is read). Bounds compared:

- ``box``: Quest's channel-wise max/min box per KV block (what the kernels used before the sketch);
- ``box/16``, ``box/8``: the same box per sub-block of 16 or 8 tokens;
- ``pair``: per RoPE channel pair (the two channels one frequency rotates together) the smaller of the box and
  ``|q_pair| * max |k_pair|`` (a disc instead of a square);
- ``pca``: the box in a per-layer, per-KV-head orthonormal basis (the principal axes of that head's keys on
  another prompt), in which keys are compact;
- ``box-top1``: the box of each block without its single best-scoring token: how much one token per block (a
  sink-like token) widens the bound;
- ``int4-box``, ``int8-box``: each key as 4- or 8-bit codes within its block's box (tight, but a code goes stale
  when its block's box widens);
- ``sketch``: kvreuse's key sketch (``kvreuse.kernels.key_sketch``: int8 codes, one scale per token);
- ``kvreuse``: the sketch with the threshold the kernels use, the sketch's largest lower bound minus beta (closer
  to the true maximum than the window's best logit).

Also per layer: how far the window's best logit ``s`` lies below the true maximum, the share of the bound's
excess over the block's true best logit (``U - max``) carried by each RoPE frequency band, and the keys' spread
per channel (outlier channels).

Run: ``KVREUSE_DATASETS=/work/shared/datasets .venv/bin/python benchmarks/sparse_real_keys.py`` (dumps once into
``build/real_keys/``, ~1 GB, then analyses; ``--fixture`` also writes the small real-key fixture of the unit tests
and of ``sparse_decode_gpu.py``). Prints per-layer tables at beta 4 and a summary over layer groups, and writes
``sparse_real_keys.json`` under ``build/benchmarks/`` (``--update-results``: into ``docs/benchmarks/results/``, the
figures the docs cite).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, output_dir, write_results  # noqa: E402
from retrieval_cases import make_case  # noqa: E402

from kvreuse.kernels.key_sketch import logit_bounds_reference, sketch_reference  # noqa: E402

MODEL = REPO / "build" / "models" / "smollm2"
DUMPS = REPO / "build" / "real_keys"
FIXTURE = REPO / "tests" / "data" / "smollm2_keys.pt"
CASES = [("needle", 2048, 0), ("multi", 2048, 1), ("needle", 4096, 0), ("multi", 4096, 1), ("needle", 8000, 0)]
DECODE_TOKENS = 16
BETAS = [8.0, 4.0, 2.0, 1.0]
SINK, LOCAL, BLOCK = 16, 64, 32


def dump(kind: str, tokens: int, index: int) -> Path:
    """Keys (after and before RoPE) of every layer and the decode queries of one case (cached on disk)."""
    path = DUMPS / f"{kind}_{tokens}_{index}.pt"
    if path.exists():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama import modeling_llama

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    def chat(message: str) -> str:
        messages = [{"role": "user", "content": message}]
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    case = make_case(kind, tokens, index, count, chat)
    ids = tok(case.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=DECODE_TOKENS, do_sample=False)
    n_prompt = ids.shape[1]
    upto = full.shape[1] - 1  # the answer may end (EOS) before DECODE_TOKENS
    captured: dict[int, dict[str, torch.Tensor]] = {}

    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        q_rot, k_rot = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        captured[module.layer_idx] = {
            "keys": k_rot[0].transpose(0, 1).contiguous(),  # [n, kv_heads, dim]
            "keys_pre_rope": k[0].transpose(0, 1).contiguous(),
            "queries": q_rot[0, :, n_prompt - 1 : upto].transpose(0, 1).clone(),
        }

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(full[:, :upto])
    for h in handles:
        h.remove()
    DUMPS.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "case": {"kind": kind, "tokens": tokens, "index": index, "answer": case.answer},
            "n_prompt": n_prompt,
            "token_ids": full[0, :upto],
            "completion": tok.decode(full[0, n_prompt:]),
            "query_positions": torch.arange(n_prompt - 1, upto),
            "scale": model.model.layers[0].self_attn.scaling,
            "layers": [captured[i] for i in range(len(model.model.layers))],
        },
        path,
    )
    return path


# ----------------------------------------------------------------------------------------------------------------
# Bounds


def grouped(keys: torch.Tensor, size: int) -> torch.Tensor:
    """``keys[n, d]`` as ``[ceil(n / size), size, d]``, the last group padded with its last key (no wider box)."""
    n, d = keys.shape
    groups = -(-n // size)
    return torch.cat([keys, keys[-1:].expand(groups * size - n, d)]).view(groups, size, d)


def box_upper(q: torch.Tensor, keys: torch.Tensor, size: int) -> torch.Tensor:
    """Quest's bound per group of ``size`` tokens: ``q[Q, d]``, ``keys[n, d]`` -> ``[Q, ceil(n / size)]``."""
    g = grouped(keys, size)
    hi, lo = g.amax(1), g.amin(1)
    return q.clamp(min=0) @ hi.T + q.clamp(max=0) @ lo.T


def pair_upper(q: torch.Tensor, keys: torch.Tensor, size: int) -> torch.Tensor:
    """Per RoPE pair (channels i and i + d/2), the smaller of the box bound and |q_pair| max |k_pair|."""
    g = grouped(keys, size)
    hi, lo = g.amax(1), g.amin(1)
    box = torch.maximum(q[:, None] * hi, q[:, None] * lo)  # [Q, groups, d]
    half = q.shape[1] // 2
    radius = g[..., :half].hypot(g[..., half:]).amax(1)  # [groups, half]
    q_norm = q[:, :half].hypot(q[:, half:])  # [Q, half]
    return torch.minimum(box[..., :half] + box[..., half:], q_norm[:, None] * radius[None]).sum(-1)


def box_without_best(q: torch.Tensor, keys: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Quest's bound per block with each query's best token of the block left out (``best[Q, blocks]``, offsets):
    from the two largest and two smallest values per channel."""
    g = grouped(keys, BLOCK)
    top = g.topk(2, dim=1)  # [blocks, 2, d]
    bottom = g.topk(2, dim=1, largest=False)
    hi = torch.where(top.indices[None, :, 0] == best[..., None], top.values[None, :, 1], top.values[None, :, 0])
    lo = torch.where(
        bottom.indices[None, :, 0] == best[..., None], bottom.values[None, :, 1], bottom.values[None, :, 0]
    )
    return torch.maximum(q[:, None] * hi, q[:, None] * lo).sum(-1)


def box_code_upper(q: torch.Tensor, keys: torch.Tensor, levels: int) -> torch.Tensor:
    """Per block, the largest per-token bound when each key is kept as a code of ``levels + 1`` steps within its
    block's box: ``q . k_j <= q . k~_j + sum_c |q_c| step_c / 2`` with ``k~ = m + code * step``,
    ``step = (M - m) / levels``. ``[Q, blocks]``. (Tight, but a code goes stale when its block's box widens.)"""
    g = grouped(keys, BLOCK)  # [blocks, B, d]
    hi, lo = g.amax(1, keepdim=True), g.amin(1, keepdim=True)
    step = (hi - lo) / levels
    codes = torch.where(step > 0, ((g - lo) / step.clamp(min=1e-30)).round(), torch.zeros_like(g))
    approx = lo + codes * step  # [blocks, B, d]
    slack = q.abs() @ (step[:, 0] / 2).T  # [Q, blocks]
    return torch.einsum("qd,bjd->qbj", q, approx).amax(-1) + slack


def sketch_upper(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per block, the largest upper bound of kvreuse's key sketch (``kvreuse.kernels.key_sketch``: int8 codes with
    one scale per token). ``[Q, blocks]``."""
    codes, scales = sketch_reference(keys)
    upper, _ = logit_bounds_reference(q, codes, scales)
    n = len(keys)
    blocks = -(-n // BLOCK)
    return (
        torch.cat([upper, upper.new_full((len(q), blocks * BLOCK - n), -math.inf)], 1).view(len(q), blocks, -1).amax(-1)
    )


def analyse_case(path: Path, basis: dict[tuple[int, int], torch.Tensor] | None) -> dict:
    """Per layer: read fractions of each bound at each beta, and the diagnostics of the module docstring.

    All decode queries are taken against the prompt's keys (the ``< DECODE_TOKENS`` answer tokens before a query
    lie in its local window, which is read anyway)."""
    data = torch.load(path)
    scale = data["scale"]
    n = data["n_prompt"]
    out: dict = {"case": data["case"], "completion": data["completion"], "tokens": n, "layers": []}
    blocks = -(-n // BLOCK)
    block_of = torch.arange(n) // BLOCK
    window = torch.zeros(n, dtype=torch.bool)
    window[:SINK] = True
    window[max(0, n - LOCAL) :] = True
    outside = torch.ones(blocks, dtype=torch.bool)
    outside[block_of[window].unique()] = False
    for layer, tensors in enumerate(data["layers"]):
        keys_all, queries = tensors["keys"][:n].float(), tensors["queries"].float()
        kv_heads, group = keys_all.shape[1], queries.shape[1] // keys_all.shape[1]
        counts: dict[str, dict[float, float]] = {}
        gaps, excess, bands, sink_best = [], [], torch.zeros(4), []
        for h in range(kv_heads):
            keys = keys_all[:, h]
            q = queries[:, h * group : (h + 1) * group].reshape(-1, keys.shape[1]) * scale  # [Q, d]
            logits = q @ keys.T  # [Q, n]
            s = logits[:, window].amax(1)
            gaps.append(logits.amax(1) - s)
            sink_best.append((logits.argmax(1) < SINK).float())
            padded = torch.cat([logits, logits.new_full((len(q), blocks * BLOCK - n), -math.inf)], 1)
            per_block = padded.view(len(q), blocks, BLOCK)
            block_max, best = per_block.max(-1)  # [Q, blocks]
            uppers = {
                "box": box_upper(q, keys, BLOCK),
                "pair": pair_upper(q, keys, BLOCK),
                "box-top1": box_without_best(q, keys, best),
                "int8-box": box_code_upper(q, keys, 255),
                "int4-box": box_code_upper(q, keys, 15),
                "sketch": sketch_upper(q, keys),
            }
            for sub in (16, 8):  # a block is read if one of its sub-blocks' bounds reaches tau
                u = box_upper(q, keys, sub)
                u = torch.cat([u, u.new_full((len(q), blocks * (BLOCK // sub) - u.shape[1]), -math.inf)], 1)
                uppers[f"box/{sub}"] = u.view(len(q), blocks, BLOCK // sub).amax(-1)
            codes, code_scales = sketch_reference(keys)
            sketch_lower = logit_bounds_reference(q, codes, code_scales)[1].amax(1)  # the kernels' max for tau
            if basis is not None:
                rot = basis[(layer, h)].float()
                uppers["pca"] = box_upper(q @ rot, keys @ rot, BLOCK)
            g = grouped(keys, BLOCK)
            hi, lo = g.amax(1), g.amin(1)
            kstar = g[torch.arange(blocks)[None], best]  # [Q, blocks, d]: each block's best key for each query
            contrib = (torch.maximum(q[:, None] * hi, q[:, None] * lo) - q[:, None] * kstar)[:, outside]
            excess.append(contrib.sum(-1).flatten())
            half = q.shape[1] // 2
            by_pair = contrib[..., :half] + contrib[..., half:]  # pair 0 = the fastest RoPE frequency
            bands += torch.stack([c.sum() for c in by_pair.chunk(4, dim=-1)])
            for beta in BETAS:
                tau = (s - beta)[:, None]
                need = (block_max >= tau).view(-1, group, blocks).any(1) & outside  # per decode step, KV head
                counts.setdefault("oracle", {}).setdefault(beta, 0.0)
                counts["oracle"][beta] += float(need.sum())
                for name, u in uppers.items():
                    hit = (u >= tau).view(-1, group, blocks).any(1) & outside
                    counts.setdefault(name, {}).setdefault(beta, 0.0)
                    counts[name][beta] += float(hit.sum())
                hit = (uppers["sketch"] >= (sketch_lower - beta)[:, None]).view(-1, group, blocks).any(1) & outside
                counts.setdefault("kvreuse", {}).setdefault(beta, 0.0)
                counts["kvreuse"][beta] += float(hit.sum())
        steps = len(queries)
        total = float(outside.sum()) * steps * kv_heads
        spread = keys_all.amax(0) - keys_all.amin(0)  # [kv, d]
        out["layers"].append(
            {
                "layer": layer,
                "window_gap_nats": float(torch.cat(gaps).mean()),
                "max_in_sink_share": float(torch.cat(sink_best).mean()),
                "box_excess_nats": float(torch.cat(excess).mean()),
                "excess_share_by_band": (bands / bands.sum()).tolist(),
                "channel_spread_max_over_median": float((spread.amax(-1) / spread.median(-1).values).mean()),
                "read_fraction": {
                    name: {str(beta): v / total for beta, v in per_beta.items()} for name, per_beta in counts.items()
                },
            }
        )
    return out


def pca_basis(path: Path) -> dict[tuple[int, int], torch.Tensor]:
    """Per layer and KV head, the principal axes of that head's keys in ``path`` (centred)."""
    data = torch.load(path)
    basis = {}
    for layer, tensors in enumerate(data["layers"]):
        keys = tensors["keys"].double()
        for h in range(keys.shape[1]):
            k = keys[:, h] - keys[:, h].mean(0)
            _, _, vh = torch.linalg.svd(k, full_matrices=False)
            basis[(layer, h)] = vh.T
    return basis


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--fixture", action="store_true", help=f"also write the real-key fixture {FIXTURE.relative_to(REPO)}"
    )
    args = parser.parse_args()
    paths = [dump(*case) for case in CASES]
    calibration = dump("needle", 2048, 7)  # a different prompt fits the PCA axes
    basis = pca_basis(calibration)
    results = [analyse_case(p, basis) for p in paths]
    report(results)
    summary = summarise(results)
    write_results("sparse_real_keys", {"summary": summary, "cases": results}, output_dir(args))
    if args.fixture:
        write_fixture()


def report(results: list[dict], beta: str = "4.0") -> None:
    names = ["oracle", "box", "box/16", "box/8", "pair", "pca", "box-top1", "int4-box", "int8-box", "sketch", "kvreuse"]
    for res in results:
        case = res["case"]
        print(
            f"\n{case['kind']}, {res['tokens']} tokens, beta {beta}: completion {res['completion']!r} "
            f"(answer {case['answer']})"
        )
        print(
            f"{'layer':>5} {'s gap':>6} {'sink':>5} {'excess':>7} {'bands fast->slow':>23} "
            + " ".join(f"{n:>8}" for n in names)
        )
        for st in res["layers"]:
            bands = " ".join(f"{x:.2f}" for x in st["excess_share_by_band"])
            fr = " ".join(f"{st['read_fraction'].get(n, {}).get(beta, float('nan')):>8.3f}" for n in names)
            print(
                f"{st['layer']:>5} {st['window_gap_nats']:>6.2f} {st['max_in_sink_share']:>5.2f} "
                f"{st['box_excess_nats']:>7.2f} {bands:>23} {fr}"
            )


GROUPS = {"layer 0": range(0, 1), "layers 1-11": range(1, 12), "layers 12-29": range(12, 30), "all": range(0, 30)}


def summarise(results: list[dict], betas=("4.0", "2.0")) -> list[dict]:
    """Per case, beta and group of layers: the mean fraction of blocks outside the window each bound reads."""
    rows = []
    for res in results:
        for beta in betas:
            for group, layers in GROUPS.items():
                chosen = [st for st in res["layers"] if st["layer"] in layers]
                row = {"case": f"{res['case']['kind']} {res['tokens']}", "beta": float(beta), "layers": group}
                for name in chosen[0]["read_fraction"]:
                    row[name] = sum(st["read_fraction"][name][beta] for st in chosen) / len(chosen)
                row["box_excess_nats"] = sum(st["box_excess_nats"] for st in chosen) / len(chosen)
                rows.append(row)
    names = ["oracle", "box", "box/8", "pair", "pca", "box-top1", "int4-box", "int8-box", "sketch", "kvreuse"]
    print("\n| case | beta | layers | box excess (nats) | " + " | ".join(names) + " |")
    print("|" + "---|" * (4 + len(names)))
    for r in rows:
        print(
            f"| {r['case']} | {r['beta']:g} | {r['layers']} | {r['box_excess_nats']:.1f} | "
            + " | ".join(f"{r[n]:.3f}" for n in names)
            + " |"
        )
    return rows


FIXTURE_CASE = ("needle", 1024, 0)
FIXTURE_LAYERS = [4, 20]  # a layer that attends broadly, and one that attends to a few tokens


def write_fixture() -> None:
    """The real-key fixture of the unit tests and of ``sparse_decode_gpu.py``: two layers' keys (after RoPE) and
    decode queries of a 1K-token retrieval prompt, fp16 (0.8 MB)."""
    data = torch.load(dump(*FIXTURE_CASE))
    upto = int(data["query_positions"][len(data["layers"][0]["queries"]) - 1]) + 1
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "source": f"SmolLM2-135M-Instruct, retrieval case {FIXTURE_CASE}, benchmarks/sparse_real_keys.py",
            "scale": data["scale"],
            "layers": FIXTURE_LAYERS,
            "query_positions": data["query_positions"][: len(data["layers"][0]["queries"])].clone(),
            "keys": torch.stack([data["layers"][i]["keys"][:upto] for i in FIXTURE_LAYERS]).half(),
            "queries": torch.stack([data["layers"][i]["queries"] for i in FIXTURE_LAYERS]).half(),
        },
        FIXTURE,
    )


if __name__ == "__main__":
    main()
