"""The batch front ends' backend on an in-process ``sglang.Engine``.

``Engine.generate`` with a list of prompts submits them as one batch request, in list order, and returns one output
per prompt in that order (``{"text": ..., "meta_info": {"prompt_tokens", "cached_tokens", ...}}``), so the send
order a front end chose is the order SGLang's scheduler sees. Its radix cache must be on (SGLang's default) for
reordering to pay. A running SGLang server is reached instead through the OpenAI-compatible backend
(``kvreuse.batch.openai_server.OpenAIServerBackend``; start it with ``--enable-cache-report`` for cached-token
figures).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvreuse.batch.backend import Completion, PrefixCacheModel
from kvreuse.errors import BackendError
from kvreuse.patches import sglang_0_5


def greedy_sampling_params(max_tokens: int) -> dict[str, Any]:
    """SGLang's sampling parameters for a greedy answer of at most ``max_tokens`` tokens."""
    return {"temperature": 0.0, "max_new_tokens": max_tokens}


def completions(outputs: Any, count: int) -> list[Completion]:
    """``Engine.generate``'s outputs for ``count`` prompts as :class:`Completion` objects, in order."""
    if isinstance(outputs, dict):  # a single prompt gives a single dict
        outputs = [outputs]
    if len(outputs) != count:
        raise BackendError(f"sglang.Engine returned {len(outputs)} outputs for {count} prompts")
    result = []
    for output in outputs:
        meta = output.get("meta_info") or {}
        result.append(Completion(output["text"], meta.get("prompt_tokens"), meta.get("cached_tokens")))
    return result


class SGLangBackend:
    """Greedy completions from a running ``sglang.Engine`` (not owned: the caller shuts it down)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        tokenizer = sglang_0_5.engine_tokenizer(engine)
        # SGLang's radix cache shares prefixes at page granularity (--page-size, 1 by default).
        page_size = sglang_0_5.engine_page_size(engine)
        self.cache_model = (
            None
            if tokenizer is None
            else PrefixCacheModel(tokenize=lambda prompts: tokenizer(list(prompts))["input_ids"], block_size=page_size)
        )

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`); SGLang shows no
        progress bar for a batch, so ``progress`` is ignored."""
        if not prompts:
            return []
        outputs = self.engine.generate(prompt=list(prompts), sampling_params=greedy_sampling_params(max_tokens))
        return completions(outputs, len(prompts))


@contextmanager
def started_sglang(model: str | os.PathLike, **engine_args: Any) -> Iterator[SGLangBackend]:
    """Start ``sglang.Engine`` on ``model``, give its backend, and shut the engine down after.

    ``engine_args`` are SGLang's server arguments (``page_size=16``, ``attention_backend="kvreuse_sparse"``, ...);
    they override ``random_seed=0`` set here. kvreuse's plugins load in the engine's processes by themselves
    (the ``sglang.srt.plugins`` entry point). SGLang's engine needs a GPU.
    """
    import sglang

    engine = sglang.Engine(**{"model_path": str(model), "random_seed": 0, **engine_args})
    try:
        yield SGLangBackend(engine)
    finally:
        engine.shutdown()
