"""What the batch front ends need from an engine: greedy completions of prompts, in the order they are given.

A backend is anything with a ``generate`` method and a ``cache_model`` attribute of this shape: the in-process
``vllm.LLM`` (:class:`kvreuse.vllm.backend.VLLMBackend`), an OpenAI-compatible server such as ``vllm serve`` or SGLang
(:class:`kvreuse.batch.openai_server.OpenAIServerBackend`), or a test double. The front ends decide the send
order (that is the point of reordering), so a backend must submit the prompts in the order given and return one
completion per prompt in that same order.

Two kinds of failure, kept apart so a job loses nothing: a prompt the engine refuses (longer than the context, a
request the server answers with 400) is a :class:`Completion` with an ``error``, and the job goes on; an engine
that stops answering (dead, unreachable after the retries) raises :class:`~kvreuse.errors.BackendError`, and the
job stops with the rows answered so far. A backend that can (``stream``) hands each completion over as soon as it
is done, so the front ends write rows while the job runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvreuse.errors import BackendError

# Enough for a label or a short answer; every front end takes ``max_tokens`` to change it.
MAX_TOKENS = 32


@dataclass(frozen=True)
class Completion:
    """One prompt's answer and the engine's accounting of its prompt.

    ``prompt_tokens`` and ``cached_tokens`` (prompt tokens served from the prefix cache) are ``None`` where the
    engine does not report them, e.g. a server started without ``--enable-prompt-tokens-details``. ``error`` says
    why the engine refused this prompt (then ``text`` is empty and the counts are ``None``).
    """

    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> Completion:
        """The completion of a prompt the engine refused, saying why."""
        return cls("", None, None, error)


@dataclass(frozen=True)
class PrefixCacheModel:
    """How an engine caches prefixes: its tokenizer (prompts to token ids, as the engine tokenizes them) and
    its KV block size. With it, GGR solves on the engine's tokens (each distinct cell tokenized once) and keeps
    the best of its candidates as the engine will hit them (:class:`kvreuse.reorder.TokenHitMeasure`).

    ``prefix`` is the text the backend sends before every prompt (a chat template's preamble, up to the user's
    turn), tokenized with it by ``tokenize``: a prefix every row shares, so plans count it. ``suffix`` is the text
    it sends after every prompt (the end of the user's turn and the assistant's header): counted in every prompt's
    tokens, and so in where its last full block ends.

    ``capacity_blocks`` is how many blocks the engine's KV cache holds (``None``: unknown, taken as unbounded):
    a job larger than its cache evicts, so the order of its rows decides what is reused, and the figures a job
    reports against the table's own order replay its prompts through a cache of that size.
    """

    tokenize: Callable[[list[str]], Sequence[Sequence[int]]]
    block_size: int
    prefix: str = ""
    capacity_blocks: int | None = None
    suffix: str = ""

    def sent_tokens(self, prompts: Sequence[str]) -> Sequence[Sequence[int]]:
        """The token ids the engine gets for ``prompts``: each framed by :attr:`prefix` and :attr:`suffix`."""
        return self.tokenize([self.prefix + prompt + self.suffix for prompt in prompts])


class Backend(Protocol):
    """Greedy (temperature 0) generation over a list of prompts.

    ``cache_model`` is the engine's :class:`PrefixCacheModel` where the backend knows it (an in-process engine),
    else ``None`` (a server URL).
    """

    cache_model: PrefixCacheModel | None

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order, each at most ``max_tokens`` tokens.

        Prompts are submitted in the order given, since that is the order reordering chose for prefix reuse.
        An empty list gives an empty list. ``progress`` may show a progress bar on standard error (kvreuse's own
        backends show none: the front ends draw theirs, :mod:`kvreuse.batch.progress`).
        """
        ...


class StreamingBackend(Backend, Protocol):
    """A backend that also hands over each completion as soon as it is done (what the front ends use if present)."""

    def stream(self, prompts: Sequence[str], *, max_tokens: int) -> Iterator[tuple[int, Completion]]:
        """``(position in prompts, completion)`` for every prompt, in the order they finish.

        Prompts are submitted in the order given. A refused prompt yields a completion with an ``error``; an engine
        that stops answering raises :class:`~kvreuse.errors.BackendError` after the completions already yielded.
        """
        ...


def stream_completions(
    backend: Backend, prompts: Sequence[str], *, max_tokens: int
) -> Iterator[tuple[int, Completion]]:
    """``backend.stream`` where the backend has it, else one ``generate`` call whose completions are then handed
    over in prompt order (a backend must answer every prompt: one that does not is a ``BackendError``)."""
    if not prompts:
        return
    stream = getattr(backend, "stream", None)
    if stream is not None:
        yield from stream(prompts, max_tokens=max_tokens)
        return
    completions = backend.generate(list(prompts), max_tokens=max_tokens)
    if len(completions) != len(prompts):
        raise BackendError(
            f"the backend returned {len(completions)} completion(s) for {len(prompts)} prompt(s); "
            "a backend must answer every prompt, in order"
        )
    yield from enumerate(completions)
