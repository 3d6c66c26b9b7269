"""The pandas front end: every row gets the answer to its own prompt, whatever order the rows were sent in."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.batch import BackendError, Completion, llm_map, plan_table, run_table
from kvreuse.errors import ConfigError, TableError
from kvreuse.reorder import METHODS

INSTRUCTION = "Is this movie suitable for kids?"


class EchoBackend:
    """Answers each prompt with the prompt itself, so an answer tells which row it was asked about."""

    cache_model = None  # like a server backend: no tokenizer known, GGR alone

    def __init__(self, cached: int | None = 0) -> None:
        self.calls: list[list[str]] = []
        self.max_tokens: list[int] = []
        self.cached = cached

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        self.calls.append(list(prompts))
        self.max_tokens.append(max_tokens)
        return [Completion(p, len(p), self.cached) for p in prompts]


def fields_of(prompt: str) -> dict[str, str]:
    """The ``field: value`` lines of a prompt in the ``lines`` format."""
    instruction, body = prompt.split("\n\n", 1)
    assert instruction == INSTRUCTION
    return dict(line.split(": ", 1) for line in body.splitlines())


def movies() -> pd.DataFrame:
    """Reviews of three films, the film fields repeated per review; duplicate and non-default index labels."""
    return pd.DataFrame(
        {
            "title": ["Heat", "Up", "Heat", "Up", "Alien", "Heat"],
            "genre": ["crime", "family", "crime", "family", None, "crime"],
            "review": ["tense", "sweet", "long", "sweet", "scary", "tense"],
        },
        index=["r1", "r2", "r1", "r9", "r5", "r0"],
    )


@pytest.mark.parametrize("order", METHODS)
def test_each_row_gets_the_answer_to_its_own_values_under_every_order(order):
    df = movies()
    answers = llm_map(df, INSTRUCTION, ["title", "genre", "review"], backend=EchoBackend(), order=order)
    assert answers.index.equals(df.index)
    for position in range(len(df)):
        row = df.iloc[position]
        expected = {name: "" if pd.isna(row[name]) else row[name] for name in ("title", "genre", "review")}
        assert fields_of(answers.iloc[position]) == expected


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_answers_map_back_to_their_rows_for_random_tables(data):
    n_rows = data.draw(st.integers(0, 30))
    n_cols = data.draw(st.integers(1, 4))
    cell = st.sampled_from(["a", "b", "c", None])
    df = pd.DataFrame(
        {f"f{j}": data.draw(st.lists(cell, min_size=n_rows, max_size=n_rows)) for j in range(n_cols)},
        index=data.draw(st.lists(st.integers(0, 3), min_size=n_rows, max_size=n_rows)),
    )
    order = data.draw(st.sampled_from(["original", "sorted", "stats", "ggr"]))
    answers = llm_map(df, INSTRUCTION, backend=EchoBackend(), order=order)
    assert list(answers.index) == list(df.index)
    for position in range(n_rows):
        assert fields_of(answers.iloc[position]) == {c: "" if pd.isna(v) else v for c, v in df.iloc[position].items()}


def test_prompts_are_sent_in_the_order_the_solver_chose():
    backend = EchoBackend()
    run_table(movies(), INSTRUCTION, ["title", "genre"], backend=backend, order="ggr")
    plan = plan_table(movies(), INSTRUCTION, ["title", "genre"], order="ggr")
    assert backend.calls == [plan.prompts]
    # GGR sends the three Heat reviews, then the two Up reviews, next to each other.
    titles = [fields_of(p)["title"] for p in plan.prompts]
    assert sorted(titles) == ["Alien", "Heat", "Heat", "Heat", "Up", "Up"]
    assert len([t for i, t in enumerate(titles) if i == 0 or titles[i - 1] != t]) == 3


def test_identical_rows_are_each_asked_and_each_answered():
    df = pd.DataFrame({"title": ["Up", "Up", "Up"]}, index=[7, 7, 7])
    backend = EchoBackend()
    answers = llm_map(df, INSTRUCTION, backend=backend)
    assert len(backend.calls[0]) == 3
    assert answers.tolist() == [f"{INSTRUCTION}\n\ntitle: Up\n"] * 3


def test_an_empty_table_gives_an_empty_series_with_its_index():
    df = pd.DataFrame({"title": pd.Series([], dtype=object)}, index=pd.Index([], name="review_id"))
    result = run_table(df, INSTRUCTION, backend=EchoBackend())
    assert result.answers.empty and result.answers.index.equals(df.index)
    assert (result.figures.requests, result.figures.prompt_tokens) == (0, 0)


def test_figures_add_up_what_the_backend_reports(monkeypatch):
    # A clock of the job's own: the solver takes 0.25 s of it and the backend 2.5 s, so the figures must carry
    # exactly those spans (binary fractions: no rounding), each timed around its own work.
    from kvreuse.batch import dataframe, job

    now = [100.0]

    class SlowBackend(EchoBackend):
        def generate(self, prompts, *, max_tokens, progress=False):
            now[0] += 2.5
            return super().generate(prompts, max_tokens=max_tokens, progress=progress)

    def slow_solve(*args, **kwargs):
        now[0] += 0.25
        return real_solve(*args, **kwargs)

    real_solve = job.solve
    monkeypatch.setattr(job, "solve", slow_solve)
    clock = SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(job, "time", clock)  # times the solve
    monkeypatch.setattr(dataframe, "time", clock)  # times the answers as they stream in
    result = run_table(movies(), INSTRUCTION, ["title"], backend=SlowBackend(cached=4))
    sent = plan_table(movies(), INSTRUCTION, ["title"]).prompts
    assert result.figures.requests == 6
    assert result.figures.prompt_tokens == sum(len(p) for p in sent)
    assert result.figures.cached_tokens == 6 * 4
    assert result.figures.hit_rate == pytest.approx(24 / sum(len(p) for p in sent))
    assert (result.figures.solve_s, result.figures.generate_s) == (0.25, 2.5)


def test_cached_tokens_are_unknown_when_the_backend_does_not_report_them():
    figures = run_table(movies(), INSTRUCTION, ["title"], backend=EchoBackend(cached=None)).figures
    assert figures.cached_tokens is None and figures.hit_rate is None


def test_completions_follow_the_input_rows():
    result = run_table(movies(), INSTRUCTION, ["title", "review"], backend=EchoBackend(), order="ggr")
    assert [c.text for c in result.completions] == result.answers.tolist()


def test_max_tokens_reaches_the_backend_and_must_be_positive():
    backend = EchoBackend()
    llm_map(movies(), INSTRUCTION, ["title"], backend=backend, max_tokens=5)
    assert backend.max_tokens == [5]
    with pytest.raises(ConfigError, match="max_tokens must be a positive integer, not 0"):
        llm_map(movies(), INSTRUCTION, ["title"], backend=backend, max_tokens=0)


def test_json_format_writes_each_row_as_one_object():
    answers = llm_map(
        movies().iloc[:1], INSTRUCTION, ["title", "genre"], backend=EchoBackend(), fmt="json", order="original"
    )
    assert answers.iloc[0] == f'{INSTRUCTION}\n\n{{"title": "Heat", "genre": "crime"}}\n'


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"fields": ["title", "rating"]}, TableError, "unknown field 'rating'"),
        ({"fields": ["title"], "order": "random"}, ConfigError, "unknown reordering method 'random'"),
        ({"fields": ["title"], "fmt": "yaml"}, ConfigError, "prompt format 'yaml'"),
    ],
)
def test_bad_arguments_fail_before_anything_is_sent(kwargs, error, message):
    backend = EchoBackend()
    with pytest.raises(error, match=message):
        llm_map(movies(), INSTRUCTION, backend=backend, **kwargs)
    assert backend.calls == []


def test_a_backend_that_loses_an_answer_is_a_backend_error():
    class Lossy(EchoBackend):
        def generate(self, prompts, *, max_tokens, progress=False):
            return super().generate(prompts, max_tokens=max_tokens)[:-1]

    with pytest.raises(BackendError, match="returned 5 completion"):
        llm_map(movies(), INSTRUCTION, ["title"], backend=Lossy())


def test_plan_rows_are_a_permutation_of_the_table_positions():
    plan = plan_table(movies(), INSTRUCTION, ["title", "genre"], order="ggr")
    assert np.array_equal(np.sort(plan.rows), np.arange(6))


def test_with_the_engines_cache_model_a_free_field_plan_shares_at_least_as_many_blocks_as_any_baseline():
    from kvreuse.batch import PrefixCacheModel
    from kvreuse.reorder import block_hit_stats, prepare_table, prompts, solve

    def tokenize(texts):  # one token per word or line break, with a shared vocabulary
        vocab: dict[str, int] = {}
        return [[vocab.setdefault(w, len(vocab)) for w in t.replace("\n", " \n ").split(" ") if w] for t in texts]

    rng = np.random.default_rng(3)
    df = pd.DataFrame(
        {
            "a": rng.choice(["x", "y", "z"], 300),
            "b": rng.choice(["p", "q"], 300),
            "c": rng.choice(["u", "v"], 300),
            "long_field_name_number": rng.integers(0, 40, 300).astype(str),
            "d": rng.choice(["k", "l"], 300),
        }
    )
    plan = plan_table(df, "Q", order="ggr", field_order="free", cache_model=PrefixCacheModel(tokenize, block_size=4))
    planned = block_hit_stats(tokenize(plan.prompts), 4).hit_rate
    table = prepare_table(df, None)
    for method in ("ggr", "stats", "sorted"):
        assert planned >= block_hit_stats(tokenize(prompts(solve(table, method), table, "Q")), 4).hit_rate, method


@pytest.mark.parametrize("order", METHODS)
def test_by_default_every_row_is_asked_the_prompt_of_the_original_order_and_only_rows_move(order):
    df = movies()
    original = plan_table(df, INSTRUCTION, ["review", "genre", "title"], order="original")
    plan = plan_table(df, INSTRUCTION, ["review", "genre", "title"], order=order)
    assert dict(zip(plan.rows.tolist(), plan.prompts)) == dict(zip(original.rows.tolist(), original.prompts))


def test_free_field_order_lets_ggr_move_a_rows_fields_for_reuse():
    df = movies()
    plan = plan_table(df, INSTRUCTION, ["review", "genre", "title"], order="ggr", field_order="free")
    assert any(list(fields_of(p))[0] != "review" for p in plan.prompts)  # the unique review no longer leads


def test_global_field_order_lists_every_rows_fields_in_one_order():
    df = movies()
    plan = plan_table(df, INSTRUCTION, ["review", "genre", "title"], order="ggr", field_order="global")
    assert {tuple(fields_of(p)) for p in plan.prompts} == {("genre", "title", "review")}


@pytest.mark.parametrize("order", METHODS)
def test_pinned_fields_lead_every_prompt_and_answers_stay_with_their_rows(order):
    df = movies()
    backend = EchoBackend()
    answers = llm_map(df, INSTRUCTION, backend=backend, order=order, pin=["review", "title"])
    assert [list(fields_of(p))[:2] for p in backend.calls[0]] == [["review", "title"]] * len(df)
    for position in range(len(df)):
        assert fields_of(answers.iloc[position])["review"] == df["review"].iloc[position]


class PickyBackend(EchoBackend):
    """Streams answers; refuses prompts that mention Alien; dies (BackendError) after ``die_after`` answers."""

    def __init__(self, die_after: int | None = None) -> None:
        super().__init__()
        self.die_after = die_after
        self.asked: list[str] = []

    def stream(self, prompts, *, max_tokens):
        for position, prompt in enumerate(prompts):
            if self.die_after is not None and len(self.asked) >= self.die_after:
                raise BackendError("the engine died")
            self.asked.append(prompt)
            if "Alien" in prompt:
                yield position, Completion.failed("prompt is too long")
            else:
                yield position, Completion(prompt, len(prompt), 0)


def test_a_refused_row_has_no_answer_and_its_error_and_the_other_rows_are_answered(caplog):
    result = run_table(movies(), INSTRUCTION, ["title"], backend=PickyBackend())
    alien = movies()["title"].eq("Alien").to_numpy()
    assert result.answers[alien].tolist() == [None] and result.errors[alien].tolist() == ["prompt is too long"]
    assert all(fields_of(a)["title"] != "Alien" for a in result.answers[~alien])
    assert result.errors[~alien].isna().all()
    assert (result.figures.requests, result.figures.errors) == (6, 1)
    assert "refused 1 of 6 rows" in caplog.text


def test_with_out_a_dead_engine_keeps_the_rows_done_and_resume_asks_only_the_others(tmp_path):
    out = tmp_path / "answers.csv"
    with pytest.raises(BackendError, match="the engine died"):
        llm_map(movies(), INSTRUCTION, ["title", "review"], backend=PickyBackend(die_after=4), out=out)
    assert len(pd.read_csv(out, dtype=str, keep_default_na=False)) == 4
    second = PickyBackend()
    result = run_table(movies(), INSTRUCTION, ["title", "review"], backend=second, out=out, resume=True)
    assert len(second.asked) == 2
    written = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert written["row"].astype(int).tolist() == list(range(6))
    expected = run_table(movies(), INSTRUCTION, ["title", "review"], backend=PickyBackend())
    assert result.answers.tolist() == expected.answers.tolist()
    assert written["answer"].tolist() == [a or "" for a in expected.answers.tolist()]
