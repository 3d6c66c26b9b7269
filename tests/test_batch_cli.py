"""``kvreuse run``: clear errors without tracebacks, and a table written back with one answer per row."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from kvreuse.cli import main


class EchoHandler(BaseHTTPRequestHandler):
    """A stand-in for ``vllm serve``: answers with the prompt's field lines, sorted and joined; 4 cached tokens."""

    def do_GET(self) -> None:
        self._reply({"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fields = sorted(body["prompt"].split("\n\n", 1)[1].splitlines())
        self._reply(
            {
                "choices": [{"text": " | ".join(fields)}],
                "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}},
            }
        )

    def _reply(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # keep test output quiet
        pass


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "movies.csv"
    pd.DataFrame({"title": ["Heat", "Up", "Heat", "Alien"], "year": ["1995", "2009", "1995", ""]}).to_csv(
        path, index=False
    )
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_answers_are_written_next_to_their_rows_with_a_summary(capsys, server_url, table, tmp_path):
    out = tmp_path / "answers.csv"
    code, _, err = run(
        capsys,
        "run",
        "--table",
        str(table),
        "--prompt",
        "Kids?",
        "--fields",
        "year,title",
        "--url",
        server_url,
        "--out",
        str(out),
    )
    assert code == 0
    answers = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert answers["title"].tolist() == ["Heat", "Up", "Heat", "Alien"]
    assert answers["answer"].tolist() == [
        "title: Heat | year: 1995",
        "title: Up | year: 2009",
        "title: Heat | year: 1995",
        "title: Alien | year: ",
    ]
    assert "rows           4 (order ggr)" in err
    assert "prompt tokens  40" in err
    assert "cached tokens  16 (40.0% hit rate)" in err
    assert "s wall" in err


def test_parquet_in_and_out_and_csv_on_stdout(capsys, server_url, table, tmp_path):
    parquet = tmp_path / "movies.parquet"
    pd.read_csv(table).to_parquet(parquet)
    code, _, _ = run(
        capsys,
        "run",
        "--table",
        str(parquet),
        "--prompt",
        "Kids?",
        "--fields",
        "title",
        "--url",
        server_url,
        "--out",
        str(tmp_path / "a.parquet"),
        "--answer-column",
        "kids",
    )
    assert code == 0
    assert pd.read_parquet(tmp_path / "a.parquet")["kids"].tolist() == [
        "title: Heat",
        "title: Up",
        "title: Heat",
        "title: Alien",
    ]
    code, out, _ = run(
        capsys,
        "run",
        "--table",
        str(table),
        "--prompt",
        "Kids?",
        "--fields",
        "title",
        "--order",
        "original",
        "--url",
        server_url,
    )
    assert code == 0 and out.splitlines()[1] == "Heat,1995,title: Heat"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--table", "missing.csv"], "table file missing.csv does not exist"),
        (["--fields", "title,rating"], "unknown field 'rating'"),
        (["--out", "answers.xlsx"], "--out answers.xlsx: write a .csv or .parquet file"),
        (["--answer-column", "title"], "already has a column 'title'"),
    ],
)
def test_mistakes_end_with_a_message_and_status_1_without_a_traceback(capsys, server_url, table, argv, message):
    args = {"--table": str(table), "--prompt": "Kids?", "--url": server_url}
    args.update(zip(argv[::2], argv[1::2]))
    code, _, err = run(capsys, "run", *[item for pair in args.items() for item in pair])
    assert code == 1
    assert message in err and "Traceback" not in err


def test_an_unreadable_table_is_a_clear_error(capsys, server_url, tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    code, _, err = run(capsys, "run", "--table", str(broken), "--prompt", "Kids?", "--url", server_url)
    assert code == 1 and f"cannot read {broken}" in err


def test_an_engine_is_required(capsys, table):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--table", str(table), "--prompt", "Kids?"])
    assert exit_.value.code == 2
    assert "one of the arguments --model --url is required" in capsys.readouterr().err


def test_max_tokens_must_be_a_positive_integer_before_any_engine_starts(capsys, table):
    with pytest.raises(SystemExit):
        main(["run", "--table", str(table), "--prompt", "Kids?", "--model", "m", "--max-tokens", "0"])
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_engine_args_must_be_a_json_object(capsys, table):
    with pytest.raises(SystemExit):
        main(["run", "--table", str(table), "--prompt", "Kids?", "--model", "m", "--engine-args", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_pinned_fields_lead_every_prompt_sent(capsys, server_url, table, monkeypatch):
    import kvreuse.cli as cli

    sent: list[list[str]] = []
    plan_table = cli.plan_table

    def recording_plan_table(*args, **kwargs):
        plan = plan_table(*args, **kwargs)
        sent.append(plan.prompts)
        return plan

    monkeypatch.setattr(cli, "plan_table", recording_plan_table)
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--pin", "year", "--url", server_url]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and len(out.splitlines()) == 5
    assert [prompt.split("\n")[2].split(":")[0] for prompt in sent[0]] == ["year"] * 4


def test_an_unknown_pin_ends_with_a_message_before_any_engine_starts(capsys, table):
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Kids?", "--pin", "rating", "--model", "x")
    assert code == 1
    assert "cannot pin unknown field(s) 'rating'; the prompt's fields are 'title', 'year'" in err
