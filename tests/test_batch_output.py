"""Tables in and out of the batch front ends: strict CSV reading, and answers written row by row that read back
exactly, survive a job cut short and resume to every row exactly once."""

from __future__ import annotations

import csv
import io
import json
import random
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.batch.backend import Completion
from kvreuse.batch.output import AnswerOutput
from kvreuse.batch.table_io import csv_chunks, read_table
from kvreuse.errors import TableError

HOSTILE = ["a\rb", "line\nbreak", "\r\n", 'say "hi"', "a,b", " lead", "trail ", "", "\u2028", "é中🙂", "\x0c", "x\x00y"]


def table_of(cells: list[list[str]], columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame(cells, columns=columns, dtype=object)


def write_all(path: Path | None, table: pd.DataFrame, answers: dict[int, str], order: list[int], **kw) -> AnswerOutput:
    output = AnswerOutput(path, table, **kw)
    for row in order:
        output.write(row, answers[row], None)
    output.close(complete=True)
    return output


# -- reading: one dialect, nothing guessed, errors that name the line ------------------------------------------------


def test_a_csv_is_read_cell_for_cell_as_text(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('id,title,note\r\n01,"Heat, 1995","say ""hi""\nbye"\r\n\r\n2,,NA\r\n', encoding="utf-8")
    frame = read_table(path)
    assert frame.to_dict("list") == {"id": ["01", "2"], "title": ["Heat, 1995", ""], "note": ['say "hi"\nbye', "NA"]}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (",title\n0,Heat\n", r"line 1: column 1 has no name \(''\); a table written by pandas' to_csv without"),
        ("Unnamed: 0,title\n0,Heat\n", r"line 1: column 1 has no name \('Unnamed: 0'\)"),
        ("title,year\n0,Heat,1995\n", r"line 2: 3 fields, but the header names 2 columns .*index column"),
        ("title,year\nHeat,1995\nUp\n", r"line 3: 1 fields, but the header names 2 columns \(title, year\)"),
        ('title,year\n"Heat\n1995,x\nUp,2009\n', r"line 4: .*(unexpected end of data|expected)"),
        ("title,title\nHeat,Up\n", r"line 1: columns 1 and 2 are both named 'title'"),
        ("", r"is empty; its first line must name the columns"),
    ],
)
def test_malformed_csv_is_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "t.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TableError, match=message):
        read_table(path)


def test_a_ragged_row_is_found_however_deep_in_a_chunked_read(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b\n" + "1,2\n" * 9 + "1,2,3\n", encoding="utf-8")
    with pytest.raises(TableError, match="line 11: 3 fields"):
        list(csv_chunks(path, rows_per_chunk=4))


def test_an_index_pandas_stored_in_parquet_comes_back_as_a_column(tmp_path):
    path = tmp_path / "t.parquet"
    pd.DataFrame({"title": ["Heat", "Up"]}, index=pd.Index([7, 9], name="id")).to_parquet(path)
    assert read_table(path).to_dict("list") == {"id": [7, 9], "title": ["Heat", "Up"]}


CELL = st.text(max_size=12)


@contextmanager
def fresh_folder() -> Iterator[Path]:
    """A folder of its own for each hypothesis example (pytest's tmp_path is shared by all of them)."""
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(CELL, min_size=2, max_size=2), max_size=8))
def test_any_table_the_csv_module_writes_is_read_back_exactly(rows):
    with fresh_folder() as folder:
        check_read_back(folder / "t.csv", rows)


def check_read_back(path: Path, rows: list[list[str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as handle:
        csv.writer(handle).writerows([["a", "b"], *rows])
    try:
        frame = read_table(path)
    except TableError:  # a NUL (Python's reader refuses it): kvreuse's own error, never a crash
        assert any("\x00" in cell for row in rows for cell in row)
        return
    assert frame.values.tolist() == rows


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_any_file_is_read_or_refused_with_a_table_error(text):
    with fresh_folder() as folder:
        path = folder / "t.csv"
        path.write_text(text, encoding="utf-8")
        try:
            read_table(path)
        except TableError:
            pass


# -- writing: rows that read back exactly, whatever they hold --------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_hostile_answers_and_cells_read_back_as_one_row_each(tmp_path, suffix):
    table = table_of([[h, str(i)] for i, h in enumerate(HOSTILE)], ["text", "n"])
    answers = {i: HOSTILE[-1 - i] for i in range(len(HOSTILE))}
    order = list(range(len(HOSTILE)))
    random.Random(1).shuffle(order)
    path = tmp_path / f"answers{suffix}"
    write_all(path, table, answers, order)
    if suffix == ".csv":
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
        with path.open(encoding="utf-8", newline="") as handle:
            records = list(csv.reader(handle))[1:]
        assert [r[3] for r in records] == [answers[i].replace("\x00", "\ufffd") for i in range(len(HOSTILE))]
    elif suffix == ".jsonl":
        frame = pd.DataFrame([json.loads(line) for line in path.read_text(encoding="utf-8").splitlines(True)])
    else:
        frame = pd.read_parquet(path)
    nul = "\ufffd" if suffix == ".csv" else "\x00"
    assert len(frame) == len(HOSTILE)
    assert [int(r) for r in frame["row"]] == list(range(len(HOSTILE)))  # the table's order once complete
    assert frame["text"].tolist() == [h.replace("\x00", nul) for h in HOSTILE]
    assert frame["answer"].tolist() == [answers[i].replace("\x00", nul) for i in range(len(HOSTILE))]
    assert frame["error"].tolist() == [""] * len(HOSTILE)


@settings(max_examples=60, deadline=None)
@given(
    cells=st.lists(st.tuples(st.text(max_size=10), st.text(max_size=10)), min_size=1, max_size=10),
    data=st.data(),
)
def test_csv_round_trip_of_any_text(cells, data):
    table = table_of([[c] for c, _ in cells], ["cell"])
    answers = dict(enumerate(a for _, a in cells))
    order = data.draw(st.permutations(range(len(cells))))
    with fresh_folder() as folder:
        write_all(folder / "a.csv", table, answers, list(order))
        frame = pd.read_csv(folder / "a.csv", dtype=str, keep_default_na=False)
    assert frame["cell"].tolist() == [c.replace("\x00", "\ufffd") for c, _ in cells]
    assert frame["answer"].tolist() == [a.replace("\x00", "\ufffd") for _, a in cells]


def test_rows_are_in_the_file_as_soon_as_they_are_written(tmp_path):
    table = table_of([["x"], ["y"]], ["cell"])
    path = tmp_path / "a.csv"
    output = AnswerOutput(path, table)
    output.write(1, "second", None)
    assert pd.read_csv(path, dtype=str, keep_default_na=False).values.tolist() == [["1", "y", "second", ""]]
    output.write(0, "", "HTTP 400: too long")
    assert pd.read_csv(path, dtype=str, keep_default_na=False)["error"].tolist() == ["", "HTTP 400: too long"]
    output.close()


# -- resuming: a job cut anywhere finishes with every row exactly once -----------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_file_cut_at_any_byte_resumes_to_every_row_exactly_once(suffix, data):
    with fresh_folder() as folder:
        check_cut_and_resume(folder / f"a{suffix}", data)


def check_cut_and_resume(path: Path, data: st.DataObject) -> None:
    suffix = path.suffix
    n = data.draw(st.integers(1, 8))
    table = table_of([[data.draw(st.sampled_from(HOSTILE))] for _ in range(n)], ["cell"])
    answers = {i: data.draw(st.sampled_from(HOSTILE)) for i in range(n)}
    order = list(data.draw(st.permutations(range(n))))
    first = AnswerOutput(path, table)
    for row in order[: data.draw(st.integers(0, n))]:
        first.write(row, answers[row], None)
    first.close()
    if not first.done:  # nothing written, nothing created
        assert not path.exists()
        path.write_bytes(b"")
    raw = path.read_bytes()
    path.write_bytes(raw[: data.draw(st.integers(0, len(raw)))])  # killed while writing
    if path.stat().st_size == 0:
        path.unlink()
        resumed = AnswerOutput(path, table)
    else:
        try:
            resumed = AnswerOutput(path, table, resume=True)
        except TableError as error:  # the cut fell inside the header: refused, never misread
            assert "columns" in str(error) or "keys" in str(error)
            return
    kept = set(resumed.done)
    assert kept <= set(order)
    for row in order:
        if row not in kept:
            resumed.write(row, answers[row], None)
    resumed.close(complete=True)
    if suffix == ".csv":
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    else:
        frame = pd.DataFrame([json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()])
    assert [int(r) for r in frame["row"]] == list(range(n))
    nul = "\ufffd" if suffix == ".csv" else "\x00"
    assert frame["answer"].tolist() == [answers[i].replace("\x00", nul) for i in range(n)]


def test_parquet_rows_are_journalled_and_a_killed_job_resumes_from_the_journal(tmp_path):
    table = pd.DataFrame({"n": [10, 20, 30], "t": ["a", "b", "c"]})
    path = tmp_path / "a.parquet"
    output = AnswerOutput(path, table)
    output.write(2, "third", None)
    output._handle.close()  # killed: the Parquet file was never written, the journal was
    assert not path.exists() and (tmp_path / "a.parquet.partial.jsonl").exists()
    resumed = AnswerOutput(path, table, resume=True)
    assert set(resumed.done) == {2}
    resumed.write(0, "first", None)
    resumed.write(1, "", "refused")
    resumed.close(complete=True)
    frame = pd.read_parquet(path)
    assert frame.to_dict("list") == {
        "row": [0, 1, 2],
        "n": [10, 20, 30],
        "t": ["a", "b", "c"],
        "answer": ["first", "", "third"],
        "error": ["", "refused", ""],
    }
    assert not (tmp_path / "a.parquet.partial.jsonl").exists()


def test_an_existing_output_needs_resume_and_must_come_from_the_same_job(tmp_path):
    table = table_of([["x"], ["y"]], ["cell"])
    path = tmp_path / "a.csv"
    write_all(path, table, {0: "a", 1: "b"}, [0, 1])
    with pytest.raises(TableError, match="exists; pass --resume"):
        AnswerOutput(path, table)
    with pytest.raises(TableError, match="has the columns row, cell, answer, error, but this job writes row, other"):
        AnswerOutput(path, table_of([["x"], ["y"]], ["other"]), resume=True)
    with pytest.raises(TableError, match=r"row 1 has cell = 'y', the table has 'z'; was the table changed"):
        AnswerOutput(path, table_of([["x"], ["z"]], ["cell"]), resume=True)
    assert len(AnswerOutput(path, table, resume=True).done) == 2


def test_output_columns_may_not_shadow_the_tables(tmp_path):
    with pytest.raises(TableError, match="already has a column 'answer'"):
        AnswerOutput(tmp_path / "a.csv", table_of([["x"]], ["answer"]))
    with pytest.raises(TableError, match="resuming needs an output file"):
        AnswerOutput(None, table_of([["x"]], ["cell"]), resume=True)


def test_standard_output_gets_rows_in_the_tables_order_each_once_the_rows_before_it_are_written(capsys):
    table = table_of([["x"], ["y"], ["z"]], ["cell"])
    output = AnswerOutput(None, table)
    output.write(1, "c", None)
    assert capsys.readouterr().out == "row,cell,answer,error\r\n"  # row 1 waits for row 0
    output.write(0, "a\rb", None)
    assert list(csv.reader(io.StringIO(capsys.readouterr().out, newline=""))) == [
        ["0", "x", "a\rb", ""],
        ["1", "y", "c", ""],
    ]
    output.write(2, "d", None)
    output.close(complete=True)
    assert capsys.readouterr().out == "2,z,d,\r\n"


def test_rows_still_waiting_on_standard_output_when_a_job_stops_are_written_in_the_tables_order(capsys):
    table = table_of([["x"], ["y"], ["z"]], ["cell"])
    output = AnswerOutput(None, table)
    output.write(2, "d", None)
    output.write(1, "c", None)
    output.close()  # stopped before row 0 was answered: nothing answered is lost
    assert list(csv.reader(io.StringIO(capsys.readouterr().out, newline=""))) == [
        ["row", "cell", "answer", "error"],
        ["1", "y", "c", ""],
        ["2", "z", "d", ""],
    ]


def test_a_csv_cut_inside_a_multibyte_character_resumes(tmp_path):
    table = table_of([["x"], ["y"]], ["cell"])
    path = tmp_path / "a.csv"  # (JSON lines are ASCII)
    first = AnswerOutput(path, table)
    first.write(0, "ok", None)
    first.write(1, "é中🙂", None)
    first.close()
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.index("🙂".encode()) + 2])  # killed halfway through the emoji's four bytes
    resumed = AnswerOutput(path, table, resume=True)
    assert resumed.done == {0: ("ok", "")}
    resumed.write(1, "é中🙂", None)
    resumed.close(complete=True)
    assert AnswerOutput(path, table, resume=True).done == {0: ("ok", ""), 1: ("é中🙂", "")}


# -- no file before the first row; cells longer than the csv module's default limit ----------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_a_job_that_stops_before_its_first_row_leaves_no_file_and_the_rerun_needs_no_resume(tmp_path, suffix):
    table = table_of([["x"], ["y"]], ["cell"])
    path = tmp_path / f"a{suffix}"
    with AnswerOutput(path, table):
        pass  # the engine failed to start
    assert list(tmp_path.iterdir()) == []
    write_all(path, table, {0: "a", 1: "b"}, [0, 1])
    assert len(AnswerOutput(path, table, resume=True).done) == 2


def test_a_complete_job_over_an_empty_table_writes_the_header(tmp_path):
    path = tmp_path / "a.csv"
    AnswerOutput(path, table_of([], ["cell"])).close(complete=True)
    assert path.read_bytes() == b"row,cell,answer,error\r\n"


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_resume_keeps_rows_whose_cells_pass_the_csv_modules_default_limit(tmp_path, suffix):
    huge = "word " * 60_000  # 300,000 characters; the csv module stops at 131,072 unless told otherwise
    table = table_of([[huge], ["y"]], ["cell"])
    path = tmp_path / f"a{suffix}"
    first = AnswerOutput(path, table)
    first.write(0, huge, None)
    first.close()
    assert AnswerOutput(path, table, resume=True).done == {0: (huge, "")}


def test_a_csv_table_with_cells_past_the_csv_modules_default_limit_is_read(tmp_path):
    huge = "é" * 200_000
    path = tmp_path / "t.csv"
    path.write_text(f"id,text\r\n1,{huge}\r\n", encoding="utf-8")
    assert read_table(path)["text"].tolist() == [huge]


def test_a_csv_cell_longer_than_the_limit_is_an_error_naming_the_limit(tmp_path, monkeypatch):
    import kvreuse.batch.table_io as table_io

    monkeypatch.setattr(table_io, "CSV_FIELD_LIMIT", 1000)
    path = tmp_path / "t.csv"
    path.write_text(f"id,text\r\n1,{'x' * 1001}\r\n", encoding="utf-8")
    with pytest.raises(TableError, match="a cell is longer than 1,000 characters, .* store a table .* as Parquet"):
        read_table(path)
    out = tmp_path / "a.csv"
    out.write_text(f"row,cell,answer,error\r\n0,x,{'y' * 1001},\r\n", encoding="utf-8")
    with pytest.raises(TableError, match="a cell is longer than 1,000 characters"):
        AnswerOutput(out, table_of([["x"]], ["cell"]), resume=True)


def test_log_lines_written_while_the_progress_bar_is_drawn_go_above_it(capsys):
    import logging

    from kvreuse.batch.progress import JobProgress

    handler = logging.StreamHandler(sys.stderr)
    logger = logging.getLogger("kvreuse_test_bar")
    logger.addHandler(handler)
    try:
        with JobProgress(2) as bar:
            assert handler.stream is not sys.stderr  # written through tqdm while the bar is drawn
            logger.warning("a line above the bar")
            bar.add(Completion("a", 1, 0))
        assert handler.stream is sys.stderr
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert "a line above the bar\n" in err
