"""Tables stream into the multi-replica job chunk by chunk, from files, DuckDB and DataFrames, answers by row."""

from __future__ import annotations

import duckdb
import pandas as pd
import pytest
from test_batch_distributed import FakeReplicas

from kvreuse.batch.table_stream import answer_table_stream, prompt_rows, run_table_on_replicas, table_chunks
from kvreuse.errors import BackendError
from kvreuse.reorder import render_prompt

TITLES = ["Heat", "Up", "Heat", "Alien", "Up"]
YEARS = ["1995", "2009", "1995", None, "2009"]  # NULL is asked as the empty value
TABLE = pd.DataFrame({"title": TITLES, "year": YEARS})


def expected(fields=("title", "year")) -> list[str]:
    cells = [{"title": t, "year": y or ""} for t, y in zip(TITLES, YEARS)]
    return [render_prompt("Kids?", list(fields), [row[f] for f in fields]) for row in cells]


def test_csv_parquet_duckdb_and_dataframe_give_the_same_prompts_by_row(tmp_path):
    TABLE.to_csv(tmp_path / "t.csv", index=False)
    TABLE.to_parquet(tmp_path / "t.parquet", index=False)
    con = duckdb.connect()
    relation = con.sql(f"SELECT * FROM '{tmp_path / 't.parquet'}'")
    for source in (tmp_path / "t.csv", tmp_path / "t.parquet", relation, TABLE):
        assert list(prompt_rows(table_chunks(source, rows_per_chunk=2), "Kids?")) == list(enumerate(expected()))


def test_chunks_are_at_most_rows_per_chunk(tmp_path):
    TABLE.to_csv(tmp_path / "t.csv", index=False)
    assert [len(c) for c in table_chunks(tmp_path / "t.csv", rows_per_chunk=2)] == [2, 2, 1]


def test_a_streamed_table_is_answered_once_per_row():
    answered = dict(
        answer_table_stream(
            TABLE, "Kids?", ["year", "title"], pool=FakeReplicas(2), rows_per_chunk=2, buffer_size=2, batch_size=2
        )
    )
    assert answered.keys() == set(range(5))
    assert [answered[i].text for i in range(5)] == [p.upper() for p in expected(("year", "title"))]


def test_a_dataframe_keeps_its_index_and_order_on_replicas():
    df = TABLE.set_axis([10, 11, 12, 13, 14])
    result = run_table_on_replicas(df, "Kids?", ["title", "year"], pool=FakeReplicas(2), order="sorted", batch_size=2)
    assert result.answers.index.tolist() == [10, 11, 12, 13, 14]
    assert result.answers.tolist() == [p.upper() for p in expected()]
    assert result.figures.requests == 5


def test_an_id_column_names_the_rows_and_is_not_shown_to_the_model():
    df = TABLE.assign(rid=["a", "b", "c", "d", "e"])
    rows = list(prompt_rows(table_chunks(df, rows_per_chunk=2), "Kids?", id_column="rid"))
    assert rows == list(zip("abcde", expected()))


def test_on_replicas_pinned_fields_lead_every_prompt():
    pool = FakeReplicas(2)
    result = run_table_on_replicas(TABLE, "Kids?", ["title", "year"], pool=pool, pin=["year"], batch_size=2)
    assert result.answers.tolist() == [p.upper() for p in expected(("year", "title"))]


def test_on_replicas_rows_go_to_out_as_answered_and_resume_finishes_after_every_replica_died(tmp_path):
    out = tmp_path / "answers.csv"
    with pytest.raises(BackendError, match="every replica died"):
        run_table_on_replicas(
            TABLE,
            "Kids?",
            ["title", "year"],
            pool=FakeReplicas(1, doomed={0}, die_after=2),
            order="sorted",
            batch_size=1,
            out=out,
        )
    kept = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert len(kept) == 2
    result = run_table_on_replicas(
        TABLE, "Kids?", ["title", "year"], pool=FakeReplicas(2), order="sorted", batch_size=1, out=out, resume=True
    )
    assert result.figures.requests == 3  # only the rows the first run did not answer
    final = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert final["row"].astype(int).tolist() == list(range(5))
    assert final["answer"].tolist() == [p.upper() for p in expected()]
