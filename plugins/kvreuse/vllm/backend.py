"""The batch front ends' backend on an in-process ``vllm.LLM``, and the engine arguments kvreuse starts it with.

Prompts are added to vLLM's engine in list order (:meth:`VLLMBackend.stream`: ``LLMEngine.add_request``, then
``step`` until done), so the send order a front end chose is the order vLLM's scheduler sees, and each completion
is handed over as its request finishes. A prompt vLLM refuses (longer than the model's context) becomes that
row's error; an engine that dies raises :class:`~kvreuse.errors.BackendError`. Prefix caching must be on for
reordering to pay.

Where the model has a chat template, each prompt is sent as a chat by default (:mod:`kvreuse.batch.chat`): the
template rendered as vLLM's chat API renders it (the tokenizer's ``apply_chat_template`` with the generation
prompt, then tokenized without adding special tokens, which the template writes itself), and those token ids
generated on.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvreuse.batch.backend import Completion, PrefixCacheModel
from kvreuse.batch.chat import chat_choice, chat_messages, check_system, template_frame
from kvreuse.config import suggest
from kvreuse.errors import BackendError, ConfigError
from kvreuse.patches import vllm_0_32
from kvreuse.reorder.config import ReorderConfig
from kvreuse.vllm.engine_args import check_class_names, check_model, with_cpu_defaults
from kvreuse.vllm.settings import check_additional_config, kvreuse_flags

# What every engine the front ends start gets unless its own arguments say otherwise.
ENGINE_DEFAULTS: Mapping[str, Any] = {"enable_prefix_caching": True, "seed": 0}

# Requests added to the engine ahead of those it is running: enough for its scheduler (vLLM's default batch and
# kvreuse's prefix-affinity lookahead of 256) to choose from, bounded so a 100k-row job does not hold every
# request in the engine at once.
WINDOW = 1024

_REQUEST_IDS = itertools.count()

# vLLM's setting of whether its engine core runs in a process of its own. Engines kvreuse starts run it in the
# calling process unless the user set it: no process is spawned, so a script that starts one needs no
# ``if __name__ == "__main__":`` guard; Ctrl-C reaches one process and ends the job at once with the rows done
# (an engine core of its own gets the terminal's SIGINT too, dies, and fails the job with its tracebacks); no
# shared memory is left to leak; and vLLM's start-up lines are written once, not once per process. vLLM's CPU
# platform then runs its worker in the same process as well (its uniprocess executor).
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


class VLLMBackend:
    """Greedy completions from a running ``vllm.LLM`` (not owned: the caller shuts it down).

    ``chat``: send each prompt as the user turn of a chat rendered by the model's chat template (after a system
    turn ``system``, if given); ``None`` (the default) does so where the model has a chat template, ``False``
    sends the raw text, ``True`` refuses a model without a template.
    """

    def __init__(self, llm: Any, *, window: int = WINDOW, chat: bool | None = None, system: str | None = None) -> None:
        log_to_stderr()
        self.llm = llm
        self.window = window
        tokenizer = llm.get_tokenizer()
        vllm_config = vllm_0_32.llm_config(llm)
        has_template = getattr(tokenizer, "chat_template", None) is not None
        self.chat, self.system = chat_choice(has_template, chat, system)
        block_size = vllm_config.cache_config.block_size
        capacity = vllm_config.cache_config.num_gpu_blocks or None  # set once the engine has sized its cache
        if self.chat:

            def render(messages: list[dict[str, str]]) -> str:
                return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

            self._render: Callable[[str], str] | None = lambda prompt: render(chat_messages(prompt, self.system))
            # What vLLM's chat API does: the template writes the special tokens, the tokenizer adds none.
            tokenize = batch_tokenizer(tokenizer, special_tokens=False)
            head, tail = template_frame(render, self.system)
            self.cache_model = PrefixCacheModel(
                tokenize, block_size, prefix=head, suffix=tail, capacity_blocks=capacity
            )
        else:
            self._render = None
            self.cache_model = PrefixCacheModel(batch_tokenizer(tokenizer), block_size, capacity_blocks=capacity)
        # The engine's own reorder settings (its additional_config over KVREUSE_REORDER_*), which its scheduler
        # uses too: the front ends plan with them unless given others.
        self.reorder_config = ReorderConfig.load(kvreuse_flags(vllm_config.additional_config, "reorder"))

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`)."""
        out: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for position, completion in self.stream(prompts, max_tokens=max_tokens):
            out[position] = completion
        return out

    def stream(self, prompts: Sequence[str], *, max_tokens: int) -> Iterator[tuple[int, Completion]]:
        """``(position, completion)`` as requests finish (see :class:`kvreuse.batch.backend.StreamingBackend`)."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError

        engine = vllm_0_32.offline_engine(self.llm)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        running: dict[str, int] = {}
        waiting = iter(enumerate(prompts))
        try:
            while True:
                for position, prompt in itertools.islice(waiting, max(0, self.window - len(running))):
                    request_id = f"kvreuse-{next(_REQUEST_IDS)}"
                    try:
                        engine.add_request(request_id, self._request(prompt), params)
                    except (VLLMClientError, ValueError) as refused:  # the prompt, not the engine
                        yield position, Completion.failed(str(refused))
                        continue
                    running[request_id] = position
                if not running:
                    return
                for output in engine.step():
                    if output.finished and output.request_id in running:
                        yield running.pop(output.request_id), _completion(output)
        except (ConfigError, BackendError):
            raise
        except Exception as error:  # vLLM's EngineDeadError and whatever a dying engine raises
            raise BackendError(f"the vLLM engine stopped: {type(error).__name__}: {error}") from error
        finally:
            if running:  # interrupted: leave no request of ours behind in the engine
                try:
                    engine.abort_request(list(running))
                except Exception:  # noqa: BLE001 (the engine may be dead already)
                    pass

    def _request(self, prompt: str) -> str | dict[str, list[int]]:
        """What the engine gets for ``prompt``: the text itself, or the token ids of its rendered chat."""
        if self._render is None:
            return prompt
        return {"prompt_token_ids": list(self.cache_model.tokenize([self._render(prompt)])[0])}

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (between benchmark arms); whether vLLM did."""
        return bool(self.llm.reset_prefix_cache())


def _completion(output: Any) -> Completion:
    return Completion(output.outputs[0].text, len(output.prompt_token_ids), output.num_cached_tokens)


# vLLM's setting of where its log goes (a logging config stream name); its default is standard output.
_LOG_STREAM = "VLLM_LOGGING_STREAM"
_STDERR = "ext://sys.stderr"


def log_to_stderr() -> None:
    """Send vLLM's log (and kvreuse's, whose loggers are vLLM's children) to standard error, in this process and in
    the engine processes it starts, unless the user chose a stream (``VLLM_LOGGING_STREAM``), each warning once.

    Standard output belongs to the front ends and their user: ``kvreuse run`` without ``--out`` writes the table
    there, and a notebook's prints would have vLLM's lines between them. Before vLLM is imported the variable is
    enough; after, the handler vLLM already configured on standard output is moved. Standard error carries one line
    per fact: a warning vLLM logs again and again (one per weight of the model when it converts their type) is
    written the first time only (:class:`OnceEach`).
    """
    if os.environ.setdefault(_LOG_STREAM, _STDERR) == _STDERR:
        for handler in logging.getLogger("vllm").handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
                handler.setStream(sys.stderr)
    vllm_0_32.filter_vllm_log(f"{OnceEach.__module__}.{OnceEach.__qualname__}")


class OnceEach(logging.Filter):
    """Passes a warning (or worse) the first time its message, before its arguments are put in, is logged from
    its place in the code; drops it after. Lines below warnings pass every time."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[str, int, object]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.pathname, record.lineno, record.msg)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def check_engine_args(model: str | os.PathLike, engine_args: Mapping[str, Any]) -> None:
    """Refuse, before vLLM starts, a model path that does not exist, engine arguments vLLM does not have (naming
    the closest one) and class paths that do not import (``scheduler_cls``, ...), with kvreuse's settings in
    ``additional_config`` checked too."""
    from vllm.engine.arg_utils import EngineArgs

    check_model(model)
    known = [f.name for f in dataclasses.fields(EngineArgs)]
    for key in engine_args:
        if key not in known:
            raise ConfigError(f"{key!r} is not a vLLM engine argument{suggest(key, known)}")
        if key == "model":
            raise ConfigError("give the model with --model, not in the engine arguments")
    additional = engine_args.get("additional_config") or {}
    if not isinstance(additional, Mapping):
        raise ConfigError(f"additional_config must be an object, got {additional!r}")
    check_additional_config(additional)
    check_class_names(engine_args)


def batch_tokenizer(tokenizer: Any, *, special_tokens: bool = True) -> Callable[[list[str]], list[list[int]]]:
    """Prompts to token ids as ``tokenizer(prompts, add_special_tokens=special_tokens)["input_ids"]`` gives them,
    through the Rust tokenizer's batch encoder where there is one: planning tokenizes every distinct cell of a
    table, and transformers' per-text Python wrapping costs as much as the encoding itself."""
    fast = getattr(tokenizer, "backend_tokenizer", None)  # transformers' fast tokenizers: the Rust one
    if fast is not None and hasattr(fast, "encode_batch"):
        return lambda prompts: [
            encoding.ids for encoding in fast.encode_batch(list(prompts), add_special_tokens=special_tokens)
        ]
    return lambda prompts: tokenizer(list(prompts), add_special_tokens=special_tokens)["input_ids"]


def vllm_backend(engine_args: Mapping[str, Any], *, chat: bool | None = None, system: str | None = None) -> VLLMBackend:
    """A :class:`VLLMBackend` (``chat``, ``system`` as there) on a new ``vllm.LLM`` (``engine_args`` over
    :data:`ENGINE_DEFAULTS`, a KV cache size on vLLM's CPU build by :func:`with_cpu_defaults`), not shut down here:
    for a process that ends with the engine, such as a Ray actor. Arguments vLLM refuses, and an engine that fails
    to start, end in kvreuse's own errors."""
    log_to_stderr()
    from vllm import LLM

    with _engine_core_in_process():
        llm = _start(LLM, with_cpu_defaults({**ENGINE_DEFAULTS, **engine_args}))
    try:
        return VLLMBackend(llm, chat=chat, system=system)
    except ConfigError:
        vllm_0_32.shutdown_llm(llm)
        raise


@contextmanager
def started_vllm(
    model: str | os.PathLike[str], *, chat: bool | None = None, system: str | None = None, **engine_args: Any
) -> Iterator[VLLMBackend]:
    """Start ``vllm.LLM`` on ``model`` with prefix caching on, give its backend, and shut the engine down after.

    ``chat`` and ``system`` are :class:`VLLMBackend`'s: prompts go as chats where the model has a chat template,
    unless ``chat=False``.

    ``engine_args`` are vLLM engine arguments (``block_size=32``, ``enforce_eager=True``, ...); they override
    the two set here, ``enable_prefix_caching=True`` and ``seed=0``. On vLLM's CPU build the KV cache gets a fixed
    size when none is given (:func:`with_cpu_defaults`). The model path and the arguments' names are checked
    before vLLM starts (:func:`check_engine_args`).
    """
    check_engine_args(model, engine_args)
    check_system(system)
    backend = vllm_backend({"model": str(model), **engine_args}, chat=chat, system=system)
    try:
        yield backend
    finally:
        vllm_0_32.shutdown_llm(backend.llm)


@contextmanager
def _engine_core_in_process() -> Iterator[None]:
    """:data:`IN_PROCESS` set to ``"0"`` while vLLM builds an engine, unless the user set it; as it was after (vLLM
    reads it when it builds the engine core's client): engines the caller starts later itself are vLLM's default."""
    if IN_PROCESS in os.environ:
        yield
        return
    os.environ[IN_PROCESS] = "0"
    try:
        yield
    finally:
        os.environ.pop(IN_PROCESS, None)


def _start(llm_class: Any, args: Mapping[str, Any]) -> Any:
    import pydantic

    try:
        return llm_class(**args)
    except (TypeError, ValueError, pydantic.ValidationError) as error:  # vLLM's checks of its arguments
        raise ConfigError(f"vLLM refused the engine arguments: {_first_line(error)}") from None
    except (OSError, RuntimeError) as error:  # a model it cannot read, an engine process that died at start
        raise BackendError(
            f"vLLM did not start on {args['model']!r}: {_first_line(error)} (vLLM's log above says why)"
        ) from None


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
