"""``kvreuse run``: clear errors without tracebacks, and a table written back with one answer per row."""

from __future__ import annotations

import csv
import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest

from kvreuse.batch.calibrate import CALIBRATION_ROWS
from kvreuse.cli import build_parser, main


class EchoHandler(BaseHTTPRequestHandler):
    """A stand-in for ``vllm serve``: answers with the prompt's field lines, sorted and joined; 4 cached tokens.
    A chat (``/v1/chat/completions``) is answered from its user turn; every request is kept in ``requests``."""

    requests: list[tuple[str, dict]] = []

    def do_GET(self) -> None:
        self._reply({"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        EchoHandler.requests.append((self.path, body))
        fields = sorted(self._prompt(body).split("\n\n", 1)[1].splitlines())
        self._answer(" | ".join(fields), {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}})

    def _prompt(self, body: dict) -> str:
        """The row's prompt: the raw prompt, or a chat's user turn."""
        if self.path == "/v1/chat/completions":
            return next(m["content"] for m in body["messages"] if m["role"] == "user")
        return body["prompt"]

    def _answer(self, text: str, usage: dict) -> None:
        chat = self.path == "/v1/chat/completions"
        choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        self._reply({"choices": [choice], "usage": usage})

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
    assert list(answers.columns) == ["row", "title", "year", "answer", "error"]
    assert answers["row"].tolist() == ["0", "1", "2", "3"]
    assert answers["error"].tolist() == ["", "", "", ""]
    assert answers["title"].tolist() == ["Heat", "Up", "Heat", "Alien"]
    assert answers["answer"].tolist() == [
        "title: Heat | year: 1995",
        "title: Up | year: 2009",
        "title: Heat | year: 1995",
        "title: Alien | year: ",
    ]
    assert "rows           4 (order ggr, fields keep)" in err
    assert (
        "prefill        24 of 40 prompt tokens computed, 16 served from the prefix cache (40.0%): the engine's count"
        in err
    )
    assert "s wall: " in err and "s reading the table and reaching the server" in err


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
    lines = out.splitlines()  # rows in the table's order, each with its row number
    assert code == 0 and lines[0] == "row,title,year,answer,error"
    assert lines[1:] == [
        "0,Heat,1995,title: Heat,",
        "1,Up,2009,title: Up,",
        "2,Heat,1995,title: Heat,",
        "3,Alien,,title: Alien,",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--table", "missing.csv"], "table file missing.csv does not exist"),
        (["--fields", "title,rating"], "unknown field 'rating'"),
        (["--out", "answers.xlsx"], "--out answers.xlsx: write a .csv, .jsonl, .parquet file"),
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


def test_by_default_every_prompt_lists_the_fields_in_the_order_given(capsys, server_url, table, monkeypatch):
    import kvreuse.cli as cli

    sent: list[list[str]] = []
    plan_table = cli.plan_table

    def recording_plan_table(*args, **kwargs):
        plan = plan_table(*args, **kwargs)
        sent.append(plan.prompts)
        return plan

    monkeypatch.setattr(cli, "plan_table", recording_plan_table)
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--fields", "year,title", "--url", server_url]
    code, _, _ = run(capsys, *argv)
    assert code == 0
    assert [[line.split(":")[0] for line in prompt.split("\n")[2:4]] for prompt in sent[0]] == [["year", "title"]] * 4


def test_rows_go_to_a_server_as_chats_by_default_and_as_raw_text_with_raw(capsys, server_url, table):
    EchoHandler.requests.clear()
    base = ["run", "--table", str(table), "--prompt", "Kids?", "--fields", "title", "--url", server_url]
    code, _, _ = run(capsys, *base, "--system", "Answer yes or no.")
    assert code == 0
    assert {path for path, _ in EchoHandler.requests} == {"/v1/chat/completions"}
    assert EchoHandler.requests[0][1]["messages"][0] == {"role": "system", "content": "Answer yes or no."}
    assert EchoHandler.requests[0][1]["messages"][1]["content"].startswith("Kids?\n\ntitle: ")
    EchoHandler.requests.clear()
    code, _, _ = run(capsys, *base, "--raw")
    assert code == 0
    assert {path for path, _ in EchoHandler.requests} == {"/v1/completions"}


def test_a_system_prompt_with_raw_ends_with_a_message_before_any_engine_starts(capsys, table):
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--model", "x", "--raw", "--system", "Be brief."]
    code, _, err = run(capsys, *argv)
    assert code == 1 and "--system needs chat prompts; leave it out with --raw" in err


def test_a_run_that_fails_before_its_first_answer_leaves_no_output_to_block_the_rerun(capsys, table, tmp_path):
    out = tmp_path / "answers.csv"
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--out", str(out), "--retries", "0"]
    code, _, err = run(capsys, *argv, "--url", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert code == 1 and f"no row of 4 was answered; {out} was not written" in err
    assert not out.exists()


def test_an_unknown_pin_ends_with_a_message_before_any_engine_starts(capsys, table):
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Kids?", "--pin", "rating", "--model", "x")
    assert code == 1
    assert "cannot pin unknown field(s) 'rating'; the prompt's fields are 'title', 'year'" in err


# -- a job loses nothing: refused rows, a dying server, Ctrl-C, and --resume -----------------------------------------


class ScriptedServer(ThreadingHTTPServer):
    """An OpenAI-compatible stand-in that answers each prompt with its last line, refuses prompts containing
    TOO LONG (HTTP 400, vLLM's JSON error body), and after ``die_after`` answers either stops listening or sends
    this process Ctrl-C (``then="sigint"``) while the request waits for an answer; it closes that connection only
    when stopped, so no connection error races the Ctrl-C."""

    def __init__(self, die_after: int | None = None, then: str = "stop") -> None:
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.die_after, self.then = die_after, then
        self.answered: list[str] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.stopped.set()
        threading.Thread(target=self.shutdown, daemon=True).start()


class ScriptedHandler(EchoHandler):
    server: ScriptedServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = self._prompt(body)
        with self.server.lock:
            dying = self.server.die_after is not None and len(self.server.answered) >= self.server.die_after
            if not dying and "TOO LONG" not in prompt:
                self.server.answered.append(prompt)
        if dying:
            self._die()
        elif "TOO LONG" in prompt:
            self._status(400, {"error": {"message": "prompt is longer than the maximum context length"}})
        else:
            self._answer(prompt.splitlines()[-1], {"prompt_tokens": 10})

    def _die(self) -> None:
        """No answer: stop listening, or send Ctrl-C to the main thread (where Python handles signals; a signal
        that lands on another thread waits until the main thread runs again) and hold the request until stopped."""
        if self.server.then == "sigint":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            self.server.stopped.wait(30)
        else:
            self.server.stop()
        self.close_connection = True

    def _status(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def twelve(tmp_path: Path) -> Path:
    path = tmp_path / "twelve.csv"
    pd.DataFrame({"n": [str(i) for i in range(12)], "text": [f"value {i}" for i in range(12)]}).to_csv(
        path, index=False
    )
    return path


def job(table: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--table",
        str(table),
        "--prompt",
        "Echo",
        "--fields",
        "text",
        "--url",
        url,
        "--out",
        str(out),
        "--concurrency",
        "1",
        "--retries",
        "0",
        *extra,
    ]


def test_a_refused_row_is_written_with_its_error_and_the_job_goes_on(capsys, tmp_path):
    table = tmp_path / "t.csv"
    pd.DataFrame({"text": ["fine", "TOO LONG", "also fine"]}).to_csv(table, index=False)
    server = ScriptedServer()
    out = tmp_path / "a.csv"
    code, _, err = run(capsys, *job(table, server.url, out))
    server.stop()
    assert code == 0
    written = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert written["answer"].tolist() == ["text: fine", "", "text: also fine"]
    assert written["error"].tolist() == ["", "HTTP 400: prompt is longer than the maximum context length", ""]
    assert "errors         1 row(s) refused by the engine" in err


def test_a_dead_server_stops_the_job_with_the_rows_done_kept_and_resume_finishes_it(capsys, twelve, tmp_path):
    out = tmp_path / "a.csv"
    dying = ScriptedServer(die_after=5)
    code, _, err = run(capsys, *job(twelve, dying.url, out))
    assert code == 1 and "Traceback" not in err
    assert "5 of 12 rows were answered and are in" in err and "--resume" in err
    kept = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert len(kept) == 5 and kept["answer"].tolist() == [f"text: value {r}" for r in kept["row"].astype(int)]

    fresh = ScriptedServer()
    code, _, err = run(capsys, *job(twelve, fresh.url, out, "--resume"))
    fresh.stop()
    assert code == 0, err
    assert len(fresh.answered) == 7  # only the rows the first run did not answer
    assert "5 answered by an earlier run" in err
    done = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert done["row"].astype(int).tolist() == list(range(12))  # every row exactly once, in the table's order
    assert done["answer"].tolist() == [f"text: value {i}" for i in range(12)]


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a terminal. Python installs that handler only where SIGINT was not
    ignored when the process started, and a background job of a non-interactive shell (as CI may start pytest)
    starts with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_exits_130_with_the_rows_done_kept(capsys, twelve, tmp_path):
    out = tmp_path / "a.jsonl"
    server = ScriptedServer(die_after=4, then="sigint")
    code, _, err = run(capsys, *job(twelve, server.url, out))
    server.stop()
    assert code == 130 and "Traceback" not in err
    assert "interrupted; 4 of 12 rows were answered and are in" in err
    assert [json.loads(line)["answer"] for line in out.read_text().splitlines()] == [
        f"text: value {json.loads(line)['row']}" for line in out.read_text().splitlines()
    ]
    assert len(out.read_text().splitlines()) == 4


def test_an_existing_output_is_kept_unless_resumed(capsys, twelve, tmp_path):
    out = tmp_path / "a.csv"
    out.write_text("precious\n")
    code, _, err = run(capsys, *job(twelve, "http://127.0.0.1:9", out))
    assert code == 1 and "exists; pass --resume" in err and out.read_text() == "precious\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (",title\n0,Heat\n1,Up\n", "line 1: column 1 has no name"),
        ("title,year\nHeat,1995\nUp\n", "line 3: 1 fields, but the header names 2 columns"),
    ],
)
def test_malformed_input_is_refused_before_any_engine_starts(capsys, tmp_path, text, message):
    table = tmp_path / "t.csv"
    table.write_text(text)
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Kids?", "--model", "no/such/model")
    assert code == 1 and message in err and "Traceback" not in err


def test_the_users_solver_settings_reach_the_solver(capsys, monkeypatch, server_url, table):
    import kvreuse.batch.job as job_module

    seen = []
    real_solve = job_module.solve
    monkeypatch.setattr(job_module, "solve", lambda *a, **kw: seen.append(kw["config"]) or real_solve(*a, **kw))
    monkeypatch.setenv("KVREUSE_REORDER_MAX_DEPTH", "3")
    assert run(capsys, "run", "--table", str(table), "--prompt", "Kids?", "--url", server_url)[0] == 0
    assert seen[-1].max_depth == 3
    engine_args = json.dumps({"additional_config": {"kvreuse": {"reorder": {"min_group_hit": 2.5}}}})
    args = ["run", "--table", str(table), "--prompt", "Kids?", "--url", server_url, "--engine-args", engine_args]
    assert run(capsys, *args)[0] == 0
    assert (seen[-1].max_depth, seen[-1].min_group_hit) == (3, 2.5)


@pytest.mark.parametrize(
    ("env", "engine_args", "message"),
    [
        ({"KVREUSE_REORDER_MAX_DEPTH": "64.7"}, "{}", "reorder.max_depth (KVREUSE_REORDER_MAX_DEPTH): '64.7'"),
        ({"KVREUSE_REORDR_MAX_DEPTH": "3"}, "{}", "did you mean 'KVREUSE_REORDER_MAX_DEPTH'?"),
        ({}, '{"additional_config": {"kvreuse": {"reordr": {}}}}', "unknown section 'reordr'"),
        ({}, '{"additional_config": {"kvreuse": {"reorder": 5}}}', "the reorder settings must be a table"),
    ],
)
def test_a_wrong_setting_is_reported_at_once_before_any_engine(capsys, monkeypatch, table, env, engine_args, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--model", "no/such/model", "--engine-args"]
    code, _, err = run(capsys, *argv, engine_args)
    assert code == 1 and message in err and "Traceback" not in err


def test_a_model_folder_that_does_not_exist_is_named(capsys, table):
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Kids?", "--model", "build/models/nope")
    assert code == 1 and "model 'build/models/nope': no such folder" in err and "Traceback" not in err


def test_an_engine_argument_vllm_does_not_have_names_the_closest(capsys, table):
    model = Path(__file__).resolve().parents[1] / "build" / "models" / "small"
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--model", str(model), "--engine-args"]
    code, _, err = run(capsys, *argv, '{"blok_size": 32}')
    assert code == 1 and "'blok_size' is not a vLLM engine argument (did you mean 'block_size'?)" in err


HOSTILE = ["a\rb", "two\nlines", "\r\n", 'say "hi", then', "trailing \r", "", "é中🙂", "\u2028", "x" * 300]


class HostileHandler(EchoHandler):
    """Answers the prompt about row ``id: N`` with ``HOSTILE[N]``."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        row = int(self._prompt(body).split("id: ", 1)[1].split("\n", 1)[0])
        self._answer(HOSTILE[row], {"prompt_tokens": 1})


def test_answers_with_carriage_returns_quotes_and_commas_read_back_one_row_each(capsys, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    table = tmp_path / "t.csv"
    with table.open("w", encoding="utf-8", newline="") as handle:  # pandas' to_csv leaves a bare \r unquoted
        csv.writer(handle).writerows([["id", "text"], *([str(i), t] for i, t in enumerate(HOSTILE[::-1]))])
    out = tmp_path / "a.csv"
    url = f"http://127.0.0.1:{server.server_address[1]}"
    argv = ["run", "--table", str(table), "--prompt", "Q", "--fields", "id,text", "--order", "original"]
    code, _, err = run(capsys, *argv, "--url", url, "--out", str(out))
    server.shutdown()
    assert code == 0, err
    written = pd.read_csv(out, dtype=str, keep_default_na=False)
    assert len(written) == len(HOSTILE)
    assert written["answer"].tolist() == HOSTILE and written["text"].tolist() == HOSTILE[::-1]
    with out.open(encoding="utf-8", newline="") as handle:
        assert [r[-2] for r in csv.reader(handle)][1:] == HOSTILE


def test_a_misspelt_scheduler_class_ends_kvreuse_run_before_the_engine_starts(capsys, table):
    model = Path(__file__).resolve().parents[1] / "build" / "models" / "small"
    engine_args = json.dumps({"scheduler_cls": "kvreuse.vllm.PrefixAfinityScheduler"})
    argv = ["run", "--table", str(table), "--prompt", "Q", "--model", str(model), "--engine-args", engine_args]
    code, _, err = run(capsys, *argv)
    assert code == 1 and "kvreuse.vllm has no PrefixAfinityScheduler (did you mean" in err


def test_calibrate_prints_the_candidates_and_its_cost_on_a_line_of_its_own(capsys, server_url, table):
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--url", server_url, "--calibrate", "3"]
    code, out, err = run(capsys, *argv)
    assert code == 0 and len(out.splitlines()) == 5
    assert "calibration on 3 sample rows, " in err and "(floor: 100% identical answers)" in err
    assert err.count("<- chosen") == 1 and all(f"  {mode} " in err for mode in ("keep", "global", "free"))
    assert "and calibrating (below)" in err
    assert "\ncalibration    " in err and " requests on 3 sample rows (part of the wall time above)" in err
    assert (
        "against        the table's own order computes " in err
        and "planned on characters (the server's tokenizer is unknown)" in err
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--calibrate", "3", "--field-order", "free"], "give either --field-order or --calibrate"),
        (["--calibrate", "3", "--replicas", "2"], "--calibrate runs in one engine"),
    ],
)
def test_calibrate_conflicts_end_with_a_message_before_any_engine_starts(capsys, table, extra, message):
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Q", "--model", "x", *extra)
    assert code == 1 and message in err


def test_min_agreement_must_be_a_fraction(capsys, table):
    with pytest.raises(SystemExit):
        main(["run", "--table", str(table), "--prompt", "Q", "--model", "x", "--min-agreement", "1.5"])
    assert "'1.5' is not a fraction in [0, 1]" in capsys.readouterr().err


@pytest.fixture
def reviews(tmp_path: Path) -> Path:
    """A unique review first, then a plot repeated across a film's reviews: moving the plot first shares it."""
    path = tmp_path / "reviews.csv"
    plots = [f"the long plot of film {k % 3}, the same for every review of that film" for k in range(12)]
    pd.DataFrame({"review": [f"review {k}" for k in range(12)], "plot": plots}).to_csv(path, index=False)
    return path


def test_a_default_run_says_its_answers_are_the_original_orders_and_sends_nothing_but_the_rows(
    capsys, server_url, table
):
    EchoHandler.requests.clear()
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Kids?", "--url", server_url)
    assert code == 0 and len(EchoHandler.requests) == 4  # the rows, nothing else (no probe)
    assert "saved" not in err  # no time figure that was not measured
    assert "answers        the table's own order's: every prompt lists its fields as given (only rows moved)" in err


def test_the_original_order_is_compared_with_nothing_and_moves_no_rows(capsys, server_url, table):
    argv = ["run", "--table", str(table), "--prompt", "Kids?", "--url", server_url, "--order", "original"]
    code, _, err = run(capsys, *argv)
    assert code == 0 and "only rows moved" not in err
    assert "against        nothing: this job was sent in the table's own order" in err
    assert "answers        the table's own order's: its rows and fields as given" in err


def test_a_unique_field_before_a_shared_one_names_the_field_order_that_plans_less_and_how_to_check_it(
    capsys, server_url, reviews
):
    code, _, err = run(capsys, "run", "--table", str(reviews), "--prompt", "Q", "--url", server_url)
    line = next(line for line in err.splitlines() if line.startswith("field order    "))
    # the unique review first leaves the plot unshared; the plot first shares it across a film's reviews
    assert (
        code == 0
        and "--field-order global would compute 330 prompt characters, planned, against this job's 906" in line
    )
    assert "(2.7x fewer)" in line and "--calibrate asks sample rows in each field order" in line


def test_moved_fields_say_their_answers_were_not_compared(capsys, server_url, reviews):
    EchoHandler.requests.clear()
    argv = ["run", "--table", str(reviews), "--prompt", "Q", "--url", server_url, "--field-order", "free"]
    code, _, err = run(capsys, *argv)
    assert code == 0 and len(EchoHandler.requests) == 12 and "field order    " not in err
    assert "answers        not compared with the table's own order (fields free" in err


def test_a_calibrated_run_reports_the_agreement_it_measured(capsys, server_url, reviews):
    argv = ["run", "--table", str(reviews), "--prompt", "Q", "--url", server_url, "--calibrate", "6"]
    code, _, err = run(capsys, *argv)
    # the stand-in server answers with the fields sorted: every field order gives the same answers
    assert code == 0 and "rows           12 (order ggr, fields global)" in err
    assert "answers        100% identical to the table's own order's on 6 calibration rows" in err


def test_calibrate_without_a_number_asks_the_default_sample():
    args = build_parser().parse_args(["run", "--table", "t.csv", "--prompt", "Q", "--url", "u", "--calibrate"])
    assert args.calibrate == CALIBRATION_ROWS == 100


@pytest.fixture
def no_engine(monkeypatch) -> None:
    """Fails the test if ``kvreuse run`` reaches the point of starting an engine (or connecting to a server)."""

    def refused(args):
        raise AssertionError("an engine was started")

    monkeypatch.setattr("kvreuse.cli._backend", refused)


def one_line_error(capsys, *argv: str) -> str:
    """Run ``kvreuse`` (argparse's mistakes exit through SystemExit); the single line it wrote on standard error."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize(
    ("flag", "closest"),
    [("--feilds", "--fields"), ("--tabel", "--table"), ("--min-agrement", "--min-agreement"), ("--oder", "--order")],
)
def test_a_misspelt_flag_is_one_line_naming_the_flag_it_resembles(capsys, table, no_engine, flag, closest):
    line = one_line_error(capsys, "run", "--table", str(table), "--prompt", "Q", "--model", "m", flag, "x")
    assert line == f"kvreuse run: error: unknown flag {flag}; did you mean {closest}? (see kvreuse run --help)"


def test_any_other_argument_mistake_is_one_line_too(capsys, table, no_engine):
    line = one_line_error(capsys, "run", "--table", str(table), "--prompt", "Q")
    assert line == "kvreuse run: error: one of the arguments --model --url is required (see kvreuse run --help)"


def test_an_output_in_a_folder_that_does_not_exist_is_refused_before_the_engine(capsys, table, tmp_path, no_engine):
    out = tmp_path / "missing" / "answers.csv"
    line = one_line_error(capsys, "run", "--table", str(table), "--prompt", "Q", "--model", "m", "--out", str(out))
    assert line == (
        f"kvreuse run: error: --out {out}: the folder {out.parent} does not exist; create it first "
        f"(mkdir -p {out.parent})"
    )


def test_an_output_in_a_folder_without_write_permission_is_refused_before_the_engine(
    capsys, table, tmp_path, no_engine, monkeypatch
):
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr("kvreuse.cli.os.access", lambda path, mode: Path(path) != locked)  # as root, chmod is moot
    argv = ["run", "--table", str(table), "--prompt", "Q", "--model", "m", "--out", str(locked / "a.csv")]
    assert one_line_error(capsys, *argv).endswith(f"no permission to create files in {locked}")


def test_a_table_of_only_a_header_is_refused_before_the_engine(capsys, tmp_path, no_engine):
    empty = tmp_path / "empty.csv"
    empty.write_text("title,year\n")
    line = one_line_error(capsys, "run", "--table", str(empty), "--prompt", "Q", "--model", "m")
    assert line == f"kvreuse run: error: {empty} has no rows (only its header): there is nothing to ask"


def test_a_latin1_table_names_the_line_and_the_fix_and_encoding_reads_it(capsys, server_url, tmp_path, no_engine):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("title,city\nHeat,Paris\nAmélie,Paris\n".encode("latin-1"))
    line = one_line_error(capsys, "run", "--table", str(latin), "--prompt", "Q", "--model", "m")
    assert line.startswith(f"kvreuse run: error: {latin}, line 3: byte 0xe9 is not utf-8 text (")
    assert "pass --encoding latin-1 (or cp1252)" in line


def test_encoding_reads_a_latin1_table(capsys, server_url, tmp_path):
    latin = tmp_path / "latin.csv"
    latin.write_bytes("title,city\nHeat,Paris\nAmélie,Paris\n".encode("latin-1"))
    code, out, _ = run(
        capsys, "run", "--table", str(latin), "--prompt", "Q", "--url", server_url, "--encoding", "latin-1"
    )
    assert code == 0 and "Amélie" in out


def test_an_unknown_encoding_is_named(capsys, table, no_engine):
    line = one_line_error(capsys, "run", "--table", str(table), "--prompt", "Q", "--model", "m", "--encoding", "utf-9")
    assert line == "kvreuse run: error: unknown text encoding 'utf-9' (e.g. utf-8, latin-1, cp1252)"


def test_min_agreement_without_calibrate_is_refused_with_the_fix(capsys, table, no_engine):
    argv = ["run", "--table", str(table), "--prompt", "Q", "--model", "m", "--min-agreement", "0.9"]
    line = one_line_error(capsys, *argv)
    assert "--min-agreement is the floor of --calibrate and means nothing without it; add --calibrate" in line


def test_resuming_a_finished_job_exits_at_once_without_an_engine(capsys, server_url, table, tmp_path, monkeypatch):
    out = tmp_path / "a.csv"
    argv = ["run", "--table", str(table), "--prompt", "Q", "--out", str(out)]
    assert run(capsys, *argv, "--url", server_url)[0] == 0
    written = out.read_bytes()
    monkeypatch.setattr("kvreuse.cli._backend", lambda args: pytest.fail("an engine was started"))
    code, _, err = run(capsys, *argv, "--model", "m", "--resume")
    assert code == 0 and err.strip() == f"kvreuse run: all 4 rows are in {out} already; nothing to ask"
    assert out.read_bytes() == written


def test_an_engine_that_dies_of_the_users_ctrl_c_before_this_process_sees_it_is_an_interrupt(
    capsys, table, tmp_path, monkeypatch
):
    """An engine process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1) gets the terminal's SIGINT too and may die
    first: the job then ends as interrupted (130, one line), not as a failed engine (1)."""
    from contextlib import contextmanager

    import kvreuse.cli
    from kvreuse.batch.backend import Completion
    from kvreuse.errors import BackendError

    class DyingOfCtrlC:
        cache_model = None

        def stream(self, prompts, *, max_tokens):
            yield 0, Completion("a", 10, 0)
            kvreuse.cli._INTERRUPTED.set()  # what the SIGINT handler notes, its KeyboardInterrupt not seen yet
            raise BackendError("the vLLM engine stopped: EngineDeadError: EngineCore encountered an issue")

        def generate(self, prompts, *, max_tokens, progress=False):
            raise AssertionError("not used")

    @contextmanager
    def backend(args):
        yield DyingOfCtrlC()

    monkeypatch.setattr("kvreuse.cli._backend", backend)
    out = tmp_path / "a.csv"
    code, _, err = run(capsys, "run", "--table", str(table), "--prompt", "Q", "--model", "m", "--out", str(out))
    assert code == 130 and "EngineDeadError" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kvreuse run: interrupted; 1 of 4 rows were answered and are in {out}; run the same command with --resume "
        "to ask the others"
    )
