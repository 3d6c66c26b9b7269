"""DuckDB's ``llm()``: all rows of a query are asked as one batch, and each row gets the answer to its own values."""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd
import pytest

from kvreuse.batch import Completion, llm_sql, run_query
from kvreuse.batch.sql import call_sites
from kvreuse.errors import BackendError, TableError


class EchoBackend:
    """Answers each prompt with the prompt itself, so an answer tells which values it was asked about."""

    cache_model = None  # like a server backend: no tokenizer known, GGR alone

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        self.calls.append(list(prompts))
        return [Completion(p, 1, 0) for p in prompts]


def prompt(instruction: str, **fields: str) -> str:
    return instruction + "\n\n" + "".join(f"{name}: {value}\n" for name, value in fields.items())


@pytest.fixture
def con() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.execute("""CREATE TABLE movies AS SELECT * FROM (VALUES
        (1, 'Heat', 'crime'), (2, 'Up', 'family'), (3, 'Heat', 'crime'), (4, 'Alien', NULL)) t(id, title, genre)""")
    return con


def test_each_row_gets_the_answer_to_its_own_values_with_fields_named_by_the_sql(con):
    frame = llm_sql(
        con,
        "SELECT id, llm('Kids?', m.title, genre) AS answer FROM movies m ORDER BY id",
        backend=EchoBackend(),
        order="original",
    )
    assert frame["answer"].tolist() == [
        prompt("Kids?", title="Heat", genre="crime"),
        prompt("Kids?", title="Up", genre="family"),
        prompt("Kids?", title="Heat", genre="crime"),
        prompt("Kids?", title="Alien", genre=""),
    ]


def test_a_5000_row_query_is_one_backend_call_that_asks_each_distinct_row_once():
    con = duckdb.connect()
    con.execute(
        "CREATE TABLE reviews AS SELECT i AS id, 'film ' || (i % 1234) AS title, (i % 2) AS half FROM range(5000) t(i)"
    )
    backend = EchoBackend()
    result = run_query(con, "SELECT id, title, llm('Kids?', title) AS answer FROM reviews ORDER BY id", backend=backend)
    assert len(backend.calls) == 1
    assert sorted(backend.calls[0]) == sorted(prompt("Kids?", title=f"film {k}") for k in range(1234))
    assert len(result.frame) == 5000
    assert (result.frame["answer"] == "Kids?\n\ntitle: " + result.frame["title"] + "\n").all()
    assert (result.figures.requests, result.runs) == (1234, 2)


def test_rows_are_sent_in_the_order_the_method_chose(con):
    backend = EchoBackend()
    llm_sql(con, "SELECT llm('Kids?', title) FROM movies", backend=backend, order="sorted")
    assert backend.calls == [[prompt("Kids?", title=t) for t in ("Alien", "Heat", "Up")]]


def test_expressions_are_named_by_their_position_and_shared_column_names_are_qualified(con):
    sites = call_sites(con, "SELECT llm('Q', upper(a.title), a.genre, b.genre) FROM movies a, movies b")
    assert [site.fields for site in sites] == [("arg1", "a.genre", "b.genre")]


def test_two_instructions_in_one_query_share_one_backend_call(con):
    backend = EchoBackend()
    frame = llm_sql(
        con, "SELECT llm('Kids?', title) AS a, llm('Violent?', genre) AS b FROM movies WHERE id = 2", backend=backend
    )
    assert len(backend.calls) == 1
    assert frame.iloc[0].tolist() == [prompt("Kids?", title="Up"), prompt("Violent?", genre="family")]


def test_a_filter_on_an_answer_runs_the_query_again_until_every_answer_is_known(con):
    backend = EchoBackend()
    result = run_query(
        con,
        f"""SELECT id, llm('Summary?', title) AS summary FROM movies
                                WHERE llm('Kids?', genre) = '{prompt("Kids?", genre="crime")}' ORDER BY id""",
        backend=backend,
    )
    assert result.frame["id"].tolist() == [1, 3]
    assert result.frame["summary"].tolist() == [prompt("Summary?", title="Heat")] * 2
    assert [len(call) for call in backend.calls] == [3, 1]  # the filter's three genres, then the one title
    assert result.runs == 3


def test_an_llm_call_can_take_another_ones_answer(con):
    frame = llm_sql(
        con, "SELECT llm('Again?', llm('Kids?', title)) AS a FROM movies WHERE id = 2", backend=EchoBackend()
    )
    assert frame["a"].tolist() == [prompt("Again?", arg1=prompt("Kids?", title="Up"))]


def test_a_query_without_llm_runs_once_and_asks_nothing(con):
    backend = EchoBackend()
    result = run_query(con, "SELECT count(*) AS n FROM movies", backend=backend)
    assert (result.frame["n"].tolist(), result.runs, backend.calls) == ([4], 1, [])


def test_a_non_deterministic_query_is_refused(con):
    with pytest.raises(TableError, match="deterministic"):
        llm_sql(con, "SELECT llm('Kids?', random()) FROM range(3)", backend=EchoBackend())


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("SELECT llm('Kids?', title) FROM films", "Table with name films does not exist"),
        ("SELECT llm('Kids?', rating) FROM movies", "rating"),
        ("SELEC llm('Kids?', title) FROM movies", "does not parse: syntax error"),
        ("SELECT 1; SELECT llm('Kids?', title) FROM movies", "single SELECT statement; the query has 2"),
        ("CREATE TABLE x AS SELECT llm('Kids?', title) FROM movies", "single SELECT statement"),
        ("SELECT llm('Kids?') FROM movies", "needs an instruction and at least one value"),
        ("SELECT llm('Kids?', title, title) FROM movies", "passes 'title' more than once"),
    ],
)
def test_bad_queries_are_table_errors_that_name_the_problem(con, query, message):
    with pytest.raises(TableError, match=message):
        llm_sql(con, query, backend=EchoBackend())


def test_the_connection_is_left_as_it_was_even_after_an_error(con):
    with pytest.raises(TableError):
        llm_sql(con, "SELECT llm('Kids?', rating) FROM movies", backend=EchoBackend())
    llm_sql(con, "SELECT llm('Kids?', title) FROM movies", backend=EchoBackend())
    with pytest.raises(duckdb.CatalogException):
        con.execute("SELECT kvreuse_llm(0, 'Kids?', title) FROM movies").fetchall()


def test_registered_dataframes_and_non_ascii_text_work(con):
    con.register("films", pd.DataFrame({"title": ["Amélie", "Léon"]}))
    frame = llm_sql(con, "SELECT 'é' AS e, llm('Für Kinder?', title) AS a FROM films", backend=EchoBackend())
    assert frame["a"].tolist() == [prompt("Für Kinder?", title="Amélie"), prompt("Für Kinder?", title="Léon")]


def test_pinned_fields_lead_the_prompts_of_the_calls_that_pass_them(con):
    backend = EchoBackend()
    frame = llm_sql(
        con,
        "SELECT llm('Kids?', title, genre) AS a, llm('Fun?', title) AS b FROM movies",
        backend=backend,
        pin=["genre"],
    )
    assert frame["a"].tolist()[0] == prompt("Kids?", genre="crime", title="Heat")
    assert frame["b"].tolist()[0] == prompt("Fun?", title="Heat")


def test_a_pin_no_call_passes_is_an_error(con):
    with pytest.raises(TableError, match="cannot pin 'rating': no llm\\(\\) call of the query passes such a field"):
        llm_sql(con, "SELECT llm('Kids?', title, genre) FROM movies", backend=EchoBackend(), pin=["rating"])


class RefusingBackend(EchoBackend):
    """Refuses prompts about Alien; raises BackendError (a dead engine) after ``die_after`` answers."""

    def __init__(self, die_after: int | None = None) -> None:
        super().__init__()
        self.die_after, self.asked = die_after, []

    def stream(self, prompts, *, max_tokens):
        for position, text in enumerate(prompts):
            if self.die_after is not None and len(self.asked) >= self.die_after:
                raise BackendError("the engine died")
            self.asked.append(text)
            yield position, Completion.failed("too long") if "Alien" in text else Completion(text, 1, 0)


def test_a_refused_question_is_null_and_listed_and_the_other_rows_are_answered(con):
    result = run_query(con, "SELECT id, llm('Kids?', title) AS a FROM movies ORDER BY id", backend=RefusingBackend())
    assert result.frame["a"].isna().tolist() == [False, False, False, True]
    assert result.errors.to_dict("records") == [
        {"instruction": "Kids?", "fields": ["title"], "values": ["Alien"], "error": "too long"}
    ]
    assert result.figures.errors == 1 and result.runs == 2


def test_answers_are_kept_in_out_as_they_arrive_and_resume_asks_only_the_rest(con, tmp_path):
    out = tmp_path / "answers.jsonl"
    query = "SELECT id, llm('Kids?', title, genre) AS a FROM movies ORDER BY id"
    with pytest.raises(BackendError, match="the engine died"):
        run_query(con, query, backend=RefusingBackend(die_after=1), out=out, order="original")
    assert len(out.read_text().splitlines()) == 1
    with pytest.raises(TableError, match="exists; pass resume=True"):
        run_query(con, query, backend=RefusingBackend(), out=out)
    second = RefusingBackend()
    frame = run_query(con, query, backend=second, out=out, resume=True, order="original").frame
    assert len(second.asked) == 2  # three distinct questions, one answered by the first run
    assert frame["a"].tolist()[:3] == [
        prompt("Kids?", title="Heat", genre="crime"),
        prompt("Kids?", title="Up", genre="family"),
        prompt("Kids?", title="Heat", genre="crime"),
    ]
    assert len(out.read_text().splitlines()) == 3


def test_by_default_each_prompt_lists_the_fields_in_the_calls_argument_order(con):
    frame = llm_sql(
        con, "SELECT id, llm('Kids?', genre, m.title) AS answer FROM movies m ORDER BY id", backend=EchoBackend()
    )
    assert frame["answer"].tolist()[1] == prompt("Kids?", genre="family", title="Up")


def test_a_calibrated_query_keeps_the_field_order_whose_answers_agree_and_reports_it(con):
    query = "SELECT id, llm('Kids?', m.title, genre) AS answer FROM movies m ORDER BY id"
    result = run_query(con, query, backend=EchoBackend(), calibrate=2)
    (calibration,) = result.calibrations.values()
    assert calibration.chosen == "keep" and calibration.sample_rows == 2
    assert result.frame["answer"].tolist()[0] == prompt("Kids?", title="Heat", genre="crime")
