"""The batch front ends on the real engine: reordered batches give each row the answer its own prompt gets alone.

One ``vllm.LLM`` (the module's ``llm`` fixture) drives the pandas and DuckDB front ends over the first rows of
``movies_small.csv``, where a film's fields repeat across its reviews; ``kvreuse run`` starts its own engine.

The answer checks send raw prompts (``chat=False``), so that each can be asked alone as the same text; chat
prompts, the default, are checked against vLLM's own chat API on the real model (``test_chat_prompts_*``).

Each answer is checked twice: it is the text the engine generated for that row's own prompt (bookkeeping: exact),
and that generation agrees with the prompt asked alone, the reference, at every decided step (``greedy.py``): in a
batch, vLLM may take a prompt in other chunks or next to other requests, other matrix shapes, so other summation
orders (log-probabilities were seen ~1e-6 apart), and random weights make near-ties.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from greedy import LOGPROBS, assert_same_greedy_path

from kvreuse.batch import Completion, llm_map, plan_table, run_query, run_table
from kvreuse.localmodel import DATASETS, local_engine_args
from kvreuse.vllm.backend import VLLMBackend

pytestmark = pytest.mark.engine

ENGINE_ARGS: dict = {}  # the harness defaults: block size 32, prefix caching and statistics on
MOVIES = DATASETS / "movies_small.csv"  # ../shared/datasets, or KVREUSE_DATASETS
ROWS = 60
FIELDS = ["movie_title", "movie_info"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def movies() -> pd.DataFrame:
    """The first rows, indexed by review id (not 0..n-1), with cells exactly as the file has them."""
    return pd.read_csv(MOVIES, dtype=str, keep_default_na=False).head(ROWS).set_index("id")


class RecordingBackend(VLLMBackend):
    """The real backend, also keeping every prompt list it was sent (the front ends stream from it)."""

    def __init__(self, llm) -> None:
        super().__init__(llm, chat=False)
        self.calls: list[list[str]] = []

    def stream(self, prompts: Sequence[str], *, max_tokens: int) -> Iterator[tuple[int, Completion]]:
        self.calls.append(list(prompts))
        return super().stream(prompts, max_tokens=max_tokens)


class Generations:
    """The module's engine, whose requests carry log-probabilities, keeping each prompt's greedy output: what the
    backends under test read their answers from (they add requests to ``llm.llm_engine`` and step it)."""

    def __init__(self, llm) -> None:
        self.llm, self.of = llm, {}
        self.llm_engine = RecordingEngine(llm.llm_engine, self.of)

    def __getattr__(self, name: str):
        return getattr(self.llm, name)


class RecordingEngine:
    """``LLMEngine`` whose added requests ask for log-probabilities, recording each finished prompt's output."""

    def __init__(self, engine, of: dict) -> None:
        self.engine, self.of, self.prompts = engine, of, {}

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def add_request(self, request_id, prompt, params, *args, **kwargs):
        params = params.clone()
        params.logprobs = LOGPROBS
        self.prompts[request_id] = prompt
        return self.engine.add_request(request_id, prompt, params, *args, **kwargs)

    def step(self):
        outputs = self.engine.step()
        for out in outputs:
            if out.finished and out.request_id in self.prompts:
                self.of[self.prompts.pop(out.request_id)] = out.outputs[0]
        return outputs


def alone(llm, prompt: str):
    """The greedy output (with log-probabilities) of ``prompt`` generated in a request of its own: the reference."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=LOGPROBS)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def assert_agrees_with_alone(llm, generations: Generations, prompts) -> None:
    for i, prompt in enumerate(prompts):
        assert_same_greedy_path(alone(llm, prompt), generations.of[prompt], f"prompt {i}")


def test_llm_map_gives_each_row_the_answer_of_its_prompt_asked_alone(llm, movies):
    instruction = "Is this movie suitable for kids? Answer yes or no."
    generations = Generations(llm)
    backend = VLLMBackend(generations, chat=False)
    answers = llm_map(movies, instruction, FIELDS, backend=backend, order="ggr", max_tokens=MAX_TOKENS)
    plan = plan_table(movies, instruction, FIELDS, order="ggr")
    prompt_of_row = dict(zip(plan.rows.tolist(), plan.prompts))
    assert answers.index.equals(movies.index)
    assert answers.tolist() == [generations.of[prompt_of_row[row]].text for row in range(ROWS)]
    assert_agrees_with_alone(llm, generations, plan.prompts)


def test_duckdb_llm_asks_all_rows_as_one_batch_and_each_row_gets_the_answer_of_its_prompt(llm, movies):
    instruction = "Would a family enjoy this film? Answer yes or no."
    generations = Generations(llm)
    backend = RecordingBackend(generations)
    frame = run_query(
        duckdb.connect(),
        f"""
        SELECT movie_title, movie_info, llm('{instruction}', movie_title, movie_info) AS answer
        FROM (SELECT * FROM '{MOVIES}' LIMIT {ROWS})""",
        backend=backend,
        fmt="json",
        max_tokens=MAX_TOKENS,
    ).frame
    (sent,) = backend.calls
    distinct = movies[FIELDS].drop_duplicates()
    assert len(sent) == len(distinct) and len(frame) == ROWS
    by_values = {}
    for prompt in sent:
        values = json.loads(prompt.split("\n\n", 1)[1])
        by_values[values["movie_title"], values["movie_info"]] = generations.of[prompt].text
    for row in frame.itertuples():
        assert row.answer == by_values[row.movie_title, row.movie_info or ""], row.movie_title
    assert_agrees_with_alone(llm, generations, sent)


def test_ggr_with_free_field_order_serves_more_prompt_tokens_from_the_cache_than_the_original_order(llm, movies):
    """The fields as given start with the review, which no two rows share; GGR puts the film's fields first.

    (The whole job fits in the KV cache here, so vLLM finds an earlier row's prefix wherever it was sent:
    the gain measured is that of field order. Row order adds to it when the cache must evict.)
    """
    instruction = "Summarize the plot of this movie in one word."
    fields = ["review_content", "movie_title", "movie_info"]
    figures = {}
    for order in ("original", "ggr"):
        llm.reset_prefix_cache()
        figures[order] = run_table(
            movies,
            instruction,
            fields,
            backend=VLLMBackend(llm, chat=False),
            order=order,
            field_order="free",
            max_tokens=1,
        ).figures
    original, ggr = figures["original"].cached_tokens, figures["ggr"].cached_tokens
    assert original < 300 and ggr > 1500, (original, ggr)  # measured: 128 and 1888 of 7743 prompt tokens
    assert figures["ggr"].prompt_tokens == figures["original"].prompt_tokens


def test_kvreuse_run_answers_a_csv_on_the_small_model_like_llm_map(llm, small_model, movies, tmp_path):
    rows = movies.head(20).reset_index()
    table, out = tmp_path / "movies.csv", tmp_path / "answers.csv"
    rows.to_csv(table, index=False)
    engine_args = {key: value for key, value in local_engine_args(small_model).items() if key != "model"}
    instruction = "Is there an animal in this movie?"
    command = [
        str(Path(sys.executable).parent / "kvreuse"),
        "run",
        "--table",
        str(table),
        "--prompt",
        instruction,
        "--fields",
        ",".join(FIELDS),
        "--order",
        "ggr",
        "--model",
        str(small_model),
        "--engine-args",
        json.dumps(engine_args),
        "--max-tokens",
        str(MAX_TOKENS),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rows           20 (order ggr, fields keep)" in done.stderr
    assert "served from the prefix cache" in done.stderr and "against        " in done.stderr
    assert done.stdout == ""  # vLLM's log goes to standard error, which stays free for a table (no --out)
    written = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert written["row"].tolist() == [str(i) for i in range(len(rows))] and (written["error"] == "").all()
    assert written.drop(columns=["row", "answer", "error"]).equals(rows)
    # The reference: this module's engine, its prefix cache emptied, answering the same prompts in the same order in
    # one call, as the command's fresh engine of the same arguments did: the same operations in the same order, so
    # the same text, exactly.
    llm.reset_prefix_cache()
    expected = llm_map(rows, instruction, FIELDS, backend=VLLMBackend(llm), max_tokens=MAX_TOKENS)
    assert written["answer"].tolist() == expected.tolist()


def test_a_row_longer_than_the_context_is_that_rows_error_and_the_others_are_answered(llm, movies):
    rows = movies.head(4).copy()
    rows.iloc[1, rows.columns.get_loc("movie_info")] = "long " * 5000  # past max_model_len (4096)
    result = run_table(rows, "Kids?", FIELDS, backend=VLLMBackend(llm), max_tokens=2)
    assert result.answers.isna().tolist() == [False, True, False, False]
    assert result.errors.isna().tolist() == [True, False, True, True]
    assert "4096" in result.errors.iloc[1], result.errors.iloc[1]
    assert result.figures.errors == 1 and result.figures.requests == 4
