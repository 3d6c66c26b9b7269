"""What the batch front ends need from an engine: greedy completions of prompts, in the order they are given.

A backend is anything with a ``generate`` method and a ``cache_model`` attribute of this shape: the in-process
``vllm.LLM`` (:class:`kvreuse.vllm.backend.VLLMBackend`), an OpenAI-compatible server such as ``vllm serve`` or SGLang
(:class:`kvreuse.batch.openai_server.OpenAIServerBackend`), or a test double. The front ends decide the send
order (that is the point of reordering), so a backend must submit the prompts in the order given and return one
completion per prompt in that same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# Enough for a label or a short answer; every front end takes ``max_tokens`` to change it.
MAX_TOKENS = 32


@dataclass(frozen=True)
class Completion:
    """One prompt's answer and the engine's accounting of its prompt.

    ``prompt_tokens`` and ``cached_tokens`` (prompt tokens served from the prefix cache) are ``None`` where the
    engine does not report them, e.g. a server started without ``--enable-prompt-tokens-details``.
    """

    text: str
    prompt_tokens: int | None
    cached_tokens: int | None


@dataclass(frozen=True)
class PrefixCacheModel:
    """How an engine caches prefixes: its tokenizer (prompts to token ids, as the engine tokenizes them) and
    its KV block size. With it, GGR solves on the engine's tokens (each distinct cell tokenized once) and keeps
    the best of its candidates as the engine will hit them (:class:`kvreuse.reorder.TokenHitMeasure`)."""

    tokenize: Callable[[list[str]], Sequence[Sequence[int]]]
    block_size: int


class Backend(Protocol):
    """Greedy (temperature 0) generation over a list of prompts.

    ``cache_model`` is the engine's :class:`PrefixCacheModel` where the backend knows it (an in-process engine),
    else ``None`` (a server URL).
    """

    cache_model: PrefixCacheModel | None

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order, each at most ``max_tokens`` tokens.

        Prompts are submitted in the order given, since that is the order reordering chose for prefix reuse.
        An empty list gives an empty list. ``progress`` shows a progress bar on standard error.
        """
        ...
