"""The batch front ends' backend on an in-process ``vllm.LLM``.

``LLM.generate`` adds the prompts to the engine in list order and returns outputs in that order, so the send
order a front end chose is the order vLLM's scheduler sees. Prefix caching must be on for reordering to pay.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvreuse.batch.backend import Completion, PrefixCacheModel


class VLLMBackend:
    """Greedy completions from a running ``vllm.LLM`` (not owned: the caller shuts it down)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.cache_model = PrefixCacheModel(
            tokenize=batch_tokenizer(llm.get_tokenizer()),
            block_size=llm.llm_engine.vllm_config.cache_config.block_size,
        )

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`)."""
        from vllm import SamplingParams

        if not prompts:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = self.llm.generate(list(prompts), params, use_tqdm=progress)
        return [Completion(out.outputs[0].text, len(out.prompt_token_ids), out.num_cached_tokens) for out in outputs]


def batch_tokenizer(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """Prompts to token ids as ``tokenizer(prompts)["input_ids"]`` gives them (special tokens added), through the
    Rust tokenizer's batch encoder where there is one: planning tokenizes every distinct cell of a table, and
    transformers' per-text Python wrapping costs as much as the encoding itself."""
    fast = getattr(tokenizer, "_tokenizer", None)
    if fast is not None and hasattr(fast, "encode_batch"):
        return lambda prompts: [encoding.ids for encoding in fast.encode_batch(list(prompts), add_special_tokens=True)]
    return lambda prompts: tokenizer(list(prompts))["input_ids"]


@contextmanager
def started_vllm(model: str | os.PathLike, **engine_args: Any) -> Iterator[VLLMBackend]:
    """Start ``vllm.LLM`` on ``model`` with prefix caching on, give its backend, and shut the engine down after.

    ``engine_args`` are vLLM engine arguments (``block_size=32``, ``enforce_eager=True``, ...); they override
    the two set here, ``enable_prefix_caching=True`` and ``seed=0``.
    """
    from vllm import LLM

    llm = LLM(**{"model": str(model), "enable_prefix_caching": True, "seed": 0, **engine_args})
    try:
        yield VLLMBackend(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
