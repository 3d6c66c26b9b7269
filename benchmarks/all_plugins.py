"""All three plugins on one engine against the stock engine, on the real model: answers and speed.

The job: the multi-document QA set (``module_quality_data``; a chat header, several documents, one question with a
known answer), its documents registered as modules, all questions sent as one batch, as a table job sends its rows.
Two engines on SmolLM2-135M-Instruct in vLLM's CPU engine, one after the other in this process:

* ``stock``: vLLM as it comes (prefix caching on);
* ``all``: the prefix-affinity scheduler (``--scheduler-cls kvreuse.vllm.PrefixAffinityScheduler``), the module
  cache (``KVReuseModuleCache``, default recovery: ``modules.recompute_first`` 16) and kvreuse's sparse attention
  backend (``KVREUSE_SPARSE_CPU_BACKEND=1``, default ``sparse.beta`` 8), each with its defaults; the header and the
  documents are encoded first (``encode_modules``, the documents probed after the header).

Greedy, 16 tokens, stopping at ``<|im_end|>``. Figures per engine: answers right (against the known answers),
answers equal to the stock engine's, the share of prompt tokens computed, vLLM's TTFT per request (median) and the
batch's wall time (requests per second); ratios against stock come from the same run (one run of each: the two
engines cannot alternate without restarting). Prints a table, writes ``all_plugins.json`` and ``.png`` (the
harness's output folder)::

    python benchmarks/all_plugins.py --set mixed --cases 24
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from harness import bench_parser, engine, new_figure, output_dir, write_results
from module_quality import EOS_TEXT, MAX_NEW_TOKENS
from module_quality_data import HEADER, QA_SETS, is_correct, make_cases, tokenize_case

MODEL = Path(__file__).resolve().parents[1] / "build" / "models" / "smollm2"
CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
ALL = dict(
    scheduler_cls="kvreuse.vllm.PrefixAffinityScheduler",
    kv_transfer_config=CONNECTOR,
    additional_config={"kvreuse": {"modules": {"gpu_bytes": 0, "cpu_bytes": 2 << 30}}},
)


def run(arm: str, set_name: str, num_cases: int) -> dict[str, Any]:
    """One engine's answers and figures for the job."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with engine(MODEL, **(ALL if arm == "all" else {})) as llm:
        tokenizer = llm.get_tokenizer()

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        cases = make_cases(QA_SETS[set_name], encode)[:num_cases]
        tokenized = [tokenize_case(case, encode) for case in cases]
        if arm == "all":
            from kvreuse.vllm.modules import encode_modules

            header = encode(HEADER)
            unique = list(dict.fromkeys(ids for tc in tokenized for ids in tc.modules))
            encode_modules(llm, {"header": header})
            encode_modules(llm, {f"doc-{i}": list(ids) for i, ids in enumerate(unique)}, probe=header)
            llm.reset_prefix_cache()
        params = SamplingParams(
            max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=[tokenizer.convert_tokens_to_ids(EOS_TEXT)]
        )
        prompts = [TokensPrompt(prompt_token_ids=tc.prompt) for tc in tokenized]
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        texts = [out.outputs[0].text for out in outs]
        ttfts = [out.metrics.first_token_ts - out.metrics.scheduled_ts for out in outs if out.metrics is not None]
        computed = sum(len(tc.prompt) - (out.num_cached_tokens or 0) for tc, out in zip(tokenized, outs))
        return {
            "cases": len(cases),
            "right": sum(is_correct(text, case) for text, case in zip(texts, cases)),
            "texts": texts,
            "computed_share": computed / sum(len(tc.prompt) for tc in tokenized),
            "ttft_median_s": statistics.median(ttfts),
            "wall_s": wall,
            "requests_per_s": len(cases) / wall,
        }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--set", default="mixed", choices=sorted(QA_SETS))
    parser.add_argument("--cases", type=int, default=24)
    args = parser.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    stock = run("stock", args.set, args.cases)
    os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"  # read by the engine processes started from here on
    together = run("all", args.set, args.cases)
    together["agree_with_stock"] = sum(a == b for a, b in zip(together["texts"], stock["texts"]))
    stock["agree_with_stock"] = stock["cases"]
    rows = {"stock": stock, "all three": together}
    print(f"| engine | right /{args.cases} | = stock | prompt tokens computed | TTFT median | TTFT stock/engine | "
          "requests/s | throughput engine/stock |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(
            f"| {name} | {r['right']} | {r['agree_with_stock']} | {r['computed_share']:.1%} | "
            f"{r['ttft_median_s'] * 1e3:.0f} ms | {stock['ttft_median_s'] / r['ttft_median_s']:.2f}x | "
            f"{r['requests_per_s']:.2f} | {r['requests_per_s'] / stock['requests_per_s']:.2f}x |"
        )
    write_results("all_plugins", {"set": args.set, **rows}, output_dir(args), plot(rows))


def plot(rows: dict[str, dict[str, Any]]) -> Any:
    names = list(rows)
    fig, axes = new_figure(1, 3, figsize=(10, 3))
    for ax, (key, title) in zip(
        axes, (("right", "answers right"), ("ttft_median_s", "TTFT median (s)"), ("requests_per_s", "requests/s"))
    ):
        ax.bar(names, [rows[n][key] for n in names], color=["#7570b3", "#1b9e77"])
        ax.set_title(title)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
