"""The batch front ends' backend on an in-process ``sglang.Engine``.

``Engine.generate`` with a list of prompts submits them as one batch request, in list order, and returns one output
per prompt in that order (``{"text": ..., "meta_info": {"prompt_tokens", "cached_tokens", ...}}``), so the send
order a front end chose is the order SGLang's scheduler sees. Its radix cache must be on (SGLang's default) for
reordering to pay. A running SGLang server is reached instead through the OpenAI-compatible backend
(``kvreuse.batch.openai_server.OpenAIServerBackend``; start it with ``--enable-cache-report`` for cached-token
figures).

Each prompt is sent as the user turn of a chat where the model has a chat template (the front ends' default,
:mod:`kvreuse.batch.chat`), rendered as SGLang's own chat endpoint renders it: the template's text with the
generation prompt, encoded without added special tokens (the template writes them), and sent as token ids.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvreuse.batch.backend import Completion, PrefixCacheModel
from kvreuse.batch.chat import chat_choice, chat_messages, template_frame
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
    """Greedy completions from a running ``sglang.Engine`` (not owned: the caller shuts it down).

    ``chat``: send each prompt as the user turn of a chat rendered by the model's chat template (after a system
    turn ``system``, if given); ``None`` (the default) does so where the model has a chat template, ``False``
    sends the raw text, ``True`` refuses a model without a template (or an engine without a tokenizer).
    """

    def __init__(self, engine: Any, *, chat: bool | None = None, system: str | None = None) -> None:
        self.engine = engine
        tokenizer = sglang_0_5.engine_tokenizer(engine)
        # SGLang's radix cache shares prefixes at page granularity (--page-size, 1 by default).
        page_size = sglang_0_5.engine_page_size(engine)
        has_template = getattr(tokenizer, "chat_template", None) is not None
        self.chat, self.system = chat_choice(has_template, chat, system)
        self._render: Callable[[str], str] | None = None
        if self.chat:

            def render(messages: list[dict[str, str]]) -> str:
                return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

            self._render = lambda prompt: render(chat_messages(prompt, self.system))
            head, tail = template_frame(render, self.system)
            self.cache_model: PrefixCacheModel | None = PrefixCacheModel(
                lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"],
                page_size,
                prefix=head,
                suffix=tail,
            )
        elif tokenizer is not None:
            self.cache_model = PrefixCacheModel(lambda texts: tokenizer(list(texts))["input_ids"], page_size)
        else:
            self.cache_model = None

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`); SGLang shows no
        progress bar for a batch, so ``progress`` is ignored."""
        if not prompts:
            return []
        params = greedy_sampling_params(max_tokens)
        if self._render is None or self.cache_model is None:
            outputs = self.engine.generate(prompt=list(prompts), sampling_params=params)
        else:
            ids = self.cache_model.tokenize([self._render(prompt) for prompt in prompts])
            outputs = self.engine.generate(input_ids=[list(i) for i in ids], sampling_params=params)
        return completions(outputs, len(prompts))


@contextmanager
def started_sglang(
    model: str | os.PathLike, *, chat: bool | None = None, system: str | None = None, **engine_args: Any
) -> Iterator[SGLangBackend]:
    """Start ``sglang.Engine`` on ``model``, give its backend (``chat``, ``system``: see :class:`SGLangBackend`),
    and shut the engine down after.

    ``engine_args`` are SGLang's server arguments (``page_size=16``, ``attention_backend="kvreuse_sparse"``, ...);
    they override ``random_seed=0`` set here. kvreuse's plugins load in the engine's processes by themselves
    (the ``sglang.srt.plugins`` entry point). SGLang's engine needs a GPU.
    """
    import sglang

    engine = sglang.Engine(**{"model_path": str(model), "random_seed": 0, **engine_args})
    try:
        yield SGLangBackend(engine, chat=chat, system=system)
    finally:
        engine.shutdown()
