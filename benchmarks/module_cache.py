"""Module cache A/B on the real vLLM engine: Text-to-SQL over Spider schemas and a Prompt Cache style workload.

Workloads (token-id prompts, so every arm sends exactly the same tokens):

* ``spider``: each request is an instruction, 2-6 foreign-key-connected tables of one Spider database
  (``../shared/datasets/spider/tables.json``) in random order, and a question. The module cache holds the
  instruction and every table of the databases used, each table encoded after the tables it references.
* ``pml``: a PML schema of documents (movie descriptions from ``movies_small.csv``), a union of two reader
  profiles and a module with a param; each request imports 2-4 documents, one profile and the param module.

Arms, prefix caching on in all (each arm's prefix cache is reset before its requests; requests are sent one at a
time, so TTFT is a request's own prefill, not its wait behind others):

* ``stock``: vLLM as installed (CPU_ATTN);
* ``plain-layout``: kvreuse's attention backend (``beta = inf``, dense), no connector: the backend the module
  cache needs on CPU, measured alone (named for the plain layout and PyTorch attention it had when the documented
  figures were taken; it now keeps CPU_ATTN's layout and op, with the connector too);
* ``module-cache``: the same backend with the ``KVReuseModuleCache`` connector; modules are encoded before the
  timed requests (their cost is reported as ``encode_s``).

Runs on the ``large`` local model (8 layers, hidden 1024) so that prefill dominates. Usage:
``python benchmarks/module_cache.py [--workload spider,pml] [--requests 40] [--model-preset large]``; prints a table
per workload and writes ``module_cache_<workload>_<preset>.{json,png}`` under ``build/benchmarks/``
(``--update-results``: into ``docs/benchmarks/results/``, the figures the docs cite).
Random weights: the answers are not meaningful; the agreement column says how often an arm's greedy tokens
equal those of the arms before it.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, SCRATCH, ArmFigures, agreement, bench_parser, engine, output_dir, report  # noqa: E402

from kvreuse.localmodel import DATASETS, build_model  # noqa: E402

INSTRUCTION = (
    "You are an expert in SQL. Given the tables of a database below, write one SQLite query that "
    "answers the question. Use only the tables and columns given and answer with the query alone."
)
CONNECTOR = {"kv_connector": "KVReuseModuleCache", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
# recompute_first 0: this benchmark measures the plain splice (random weights: recovering answers means nothing
# here), and the README's figures were taken with it; LegoLink's default 16 is measured in module_quality_vllm.py.
DENSE = {
    "kvreuse": {
        "sparse": {"beta": float("inf")},
        "modules": {"gpu_bytes": 0, "cpu_bytes": 2 << 30, "recompute_first": 0},
    }
}


# -------------------------------------------------------------------------------------------------- workloads
def _connected_tables(schema, rng: random.Random, size: int) -> list[str]:
    """``size`` tables of ``schema`` linked by foreign keys (a random walk over the undirected key graph)."""
    names = [t.name for t in schema.tables]
    links: dict[str, set[str]] = {n: set() for n in names}
    for table in schema.tables:
        for other in schema.references(table):
            links[table.name].add(other)
            links[other].add(table.name)
    chosen = [rng.choice([n for n in names if links[n]])]
    while len(chosen) < size:
        frontier = sorted({o for n in chosen for o in links[n]} - set(chosen))
        if not frontier:
            break
        chosen.append(rng.choice(frontier))
    return chosen


def spider_workload(tokenizer, n: int, seed: int = 0):
    """(modules to encode as ``{name: text}``, their contexts by name, requests as token-id lists)."""
    from kvreuse.modules.schemas import spider_schemas
    from kvreuse.vllm.modules import module_token_ids

    rng = random.Random(seed)
    schemas = [
        s
        for s in spider_schemas(DATASETS / "spider" / "tables.json").values()
        if sum(1 for t in s.tables if t.foreign_keys) >= 2 and len(s.tables) >= 3
    ]
    picked = rng.sample(schemas, min(len(schemas), max(2, n // 5)))
    ids = {"instruction": module_token_ids(tokenizer, INSTRUCTION)}
    per_db = {}
    for schema in picked:
        per_db[schema.name] = schema
        for name, text in schema.modules():
            ids[(schema.name, name)] = module_token_ids(tokenizer, text)
    requests = []
    for i in range(n):
        schema = picked[i % len(picked)]
        tables = _connected_tables(schema, rng, rng.randint(2, min(6, len(schema.tables))))
        rng.shuffle(tables)
        column = rng.choice(schema.table(tables[0]).columns)[0]
        question = tokenizer.encode(
            f"Question: how many {tables[0]} rows have the largest {column}?\nSQL:", add_special_tokens=False
        )
        requests.append(ids["instruction"] + [t for name in tables for t in ids[(schema.name, name)]] + question)
    return per_db, ids, requests


def pml_workload(tokenizer, n: int, seed: int = 0):
    """(the PML schema text, PML prompts) over movie descriptions as documents."""
    import pandas as pd

    from kvreuse.modules.pml import escape

    rng = random.Random(seed)
    movies = pd.read_csv(DATASETS / "movies_small.csv").dropna(subset=["movie_info"]).drop_duplicates("movie_title")
    docs = [
        (f"doc{i}", f"{row.movie_title}: {row.movie_info.strip()}")
        for i, row in enumerate(movies.head(24).itertuples())
    ]
    schema = (
        '<schema name="movies"><system>You recommend movies from the descriptions given.\n</system>'
        + "".join(f'<module name="{name}">{escape(text)}\n</module>' for name, text in docs)
        + '<union><module name="casual">The reader watches for fun and likes short answers.\n</module>'
        '<module name="critic">The reader is a film critic and wants reasons.\n</module></union>'
        '<module name="ask">Recommend <param name="count" len="3"/> of these movies.\n</module></schema>'
    )
    prompts = []
    for _ in range(n):
        chosen = rng.sample([name for name, _ in docs], rng.randint(2, 4))
        profile = rng.choice(["casual", "critic"])
        prompts.append(
            f'<prompt schema="movies">{"".join(f"<{d}/>" for d in chosen)}<{profile}/>'
            f'<ask count="{rng.randint(1, 3)}"/>Which one first?</prompt>'
        )
    return schema, prompts


# ---------------------------------------------------------------------------------------------------- engines
def _figures(llm) -> dict:
    def call(worker):
        from kvreuse.vllm.runtime import module_figures

        return module_figures()

    return llm.collective_rpc(call)[0]


def run_arm(
    name: str, model: Path, requests: list[list[int]], *, plain_layout: bool, connector: bool, encode=None
) -> tuple[ArmFigures, dict]:
    import os

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if plain_layout:
        os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = "1"
    else:
        os.environ.pop("KVREUSE_SPARSE_CPU_BACKEND", None)
        AttentionBackendEnum.CPU_ATTN.clear_override()
    extra = dict(additional_config=DENSE) if plain_layout else {}
    if connector:
        extra["kv_transfer_config"] = CONNECTOR
    with engine(model, max_model_len=8192, kv_cache_memory_bytes=1 << 30, **extra) as llm:
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=requests[0])], sampling, use_tqdm=False)  # warm-up
        out: dict = {}
        if encode is not None:
            t0 = time.perf_counter()
            encode(llm)
            out["encode_s"] = round(time.perf_counter() - t0, 2)
        llm.reset_prefix_cache()
        before = _figures(llm) if connector else {}
        outputs, t0 = [], time.perf_counter()
        for prompt in requests:  # one at a time: TTFT is the request's own prefill
            outputs += llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
        wall = time.perf_counter() - t0
        if connector:
            after = _figures(llm)
            out.update(
                tokens_loaded=after["tokens_loaded"] - before["tokens_loaded"],
                load_failures=after["load_failures"] - before["load_failures"],
                load_s=round(after["load_s"] - before["load_s"], 3),
                modules=after["modules"],
                module_bytes=after["used_bytes"],
            )
    prompt_tokens = sum(len(r) for r in requests)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    ttfts = [o.metrics.first_token_latency for o in outputs]
    figures = ArmFigures(
        arm=name,
        requests=len(requests),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        engine_cache_hits=cached,
        computed_prompt_tokens=prompt_tokens - cached,
        wall_s=wall,
        prepare_s=0.0,
        ttft_median_s=statistics.median(ttfts),
        ttft_p90_s=sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
        extra=out,
    )
    answers = {i: (tuple(r), tuple(o.outputs[0].token_ids)) for i, (r, o) in enumerate(zip(requests, outputs))}
    return figures, answers


def run_workload(
    name: str, model: Path, requests: list[list[int]], encode, out_dir: Path = SCRATCH
) -> list[ArmFigures]:
    arms = [
        ("stock", dict(plain_layout=False, connector=False)),
        ("plain-layout", dict(plain_layout=True, connector=False)),
        ("module-cache", dict(plain_layout=True, connector=True, encode=encode)),
    ]
    figures, answers = [], []
    for arm, options in arms:
        fig, ans = run_arm(arm, model, requests, **options)
        fig.same_answers = agreement(ans, answers)
        figures.append(fig)
        answers.append(ans)
    stock, cached = figures[0], figures[-1]
    cached.extra["ttft_speedup_vs_stock"] = round(stock.ttft_median_s / cached.ttft_median_s, 2)
    cached.extra["ttft_speedup_vs_plain_layout"] = round(figures[1].ttft_median_s / cached.ttft_median_s, 2)
    report(name, figures, out_dir)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--workload", default="spider,pml")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--model-preset", default="large")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    model = build_model(args.model_preset, REPO / "build" / "models" / args.model_preset)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for workload in args.workload.split(","):
        if workload == "spider":
            schemas, ids, requests = spider_workload(tokenizer, args.requests)

            def encode(llm, _schemas=schemas):
                from kvreuse.vllm.modules import encode_database, encode_modules

                encode_modules(llm, {"instruction": INSTRUCTION})
                for schema in _schemas.values():
                    encode_database(llm, schema)

            run_workload(f"module_cache_spider_{args.model_preset}", model, requests, encode, output_dir(args))
        elif workload == "pml":
            from kvreuse.modules.layout import layout_schema, resolve_prompt
            from kvreuse.modules.linear import prompt_token_ids
            from kvreuse.modules.pml import parse_prompt, parse_schema

            schema, prompts = pml_workload(tokenizer, args.requests)
            tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            layout = layout_schema(parse_schema(schema), tokenize)
            requests = [prompt_token_ids(resolve_prompt(parse_prompt(p), layout, tokenize), layout) for p in prompts]

            def encode(llm, _schema=schema):
                from kvreuse.vllm.modules import encode_schema

                encode_schema(llm, _schema)

            run_workload(f"module_cache_pml_{args.model_preset}", model, requests, encode, output_dir(args))
        else:
            raise SystemExit(f"unknown workload {workload!r} (spider, pml)")


if __name__ == "__main__":
    main()
