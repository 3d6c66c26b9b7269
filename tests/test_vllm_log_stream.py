"""vLLM's log goes to standard error once kvreuse starts or wraps an engine: standard output is the table's
(``kvreuse run`` without ``--out``) and the user's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# What an engine's start does in vLLM 0.32: configure its log (from VLLM_LOGGING_STREAM), then log.
CONFIGURE = (
    "from vllm.config import LoggingConfig; from vllm.logger import configure_logging; "
    "configure_logging(LoggingConfig())"
)
LOG = "from vllm.logger import init_logger; init_logger('vllm.kvreuse_test').info('a vLLM log line')"
SET = "from kvreuse.vllm.backend import log_to_stderr; log_to_stderr()"


@pytest.mark.parametrize(
    "program",
    [f"{SET}; {CONFIGURE}; {LOG}", f"{CONFIGURE}; {SET}; {LOG}"],
    ids=["before an engine configures the log", "after (a user's own LLM)"],
)
def test_vllms_log_lines_go_to_standard_error_not_standard_output(program):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_STREAM"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a vLLM log line" in done.stderr and "a vLLM log line" not in done.stdout


def test_a_stream_the_user_chose_is_kept():
    env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stdout"}
    program = f"{SET}; {CONFIGURE}; {LOG}"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300)
    assert "a vLLM log line" in done.stdout


REPEAT = (
    "from vllm.logger import init_logger; log = init_logger('vllm.kvreuse_test'); "
    "[log.warning('Attempted to load weight %s with dtype %s', name, 'float32') for name in ('a', 'b', 'c')]; "
    "log.warning('another fact'); [log.info('an info line %d', k) for k in range(2)]"
)


def test_a_warning_vllm_repeats_is_written_once_even_after_vllm_configures_its_log_again():
    """vLLM configures its log again while an engine starts (from the engine arguments): the filter survives it."""
    program = f"{SET}; {CONFIGURE}; {REPEAT}"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("Attempted to load weight") == 1 and "weight a with" in done.stderr
    assert done.stderr.count("another fact") == 1
    assert done.stderr.count("an info line") == 2  # lines below warnings are not facts repeated
