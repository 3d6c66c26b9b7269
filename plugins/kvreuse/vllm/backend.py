"""The batch front ends' backend on an in-process ``vllm.LLM``.

``LLM.generate`` adds the prompts to the engine in list order and returns outputs in that order, so the send
order a front end chose is the order vLLM's scheduler sees. Prefix caching must be on for reordering to pay.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from kvreuse.batch.backend import Completion, PrefixCacheModel
from kvreuse.patches import vllm_0_32

# What every engine the front ends start gets unless its own arguments say otherwise.
ENGINE_DEFAULTS: Mapping[str, Any] = {"enable_prefix_caching": True, "seed": 0}


class VLLMBackend:
    """Greedy completions from a running ``vllm.LLM`` (not owned: the caller shuts it down)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        tokenizer = llm.get_tokenizer()
        self.cache_model = PrefixCacheModel(
            tokenize=lambda prompts: tokenizer(prompts)["input_ids"],
            block_size=vllm_0_32.llm_config(llm).cache_config.block_size,
        )

    def generate(self, prompts: Sequence[str], *, max_tokens: int, progress: bool = False) -> list[Completion]:
        """Completions of ``prompts`` in their order (see :class:`kvreuse.batch.Backend`)."""
        from vllm import SamplingParams

        if not prompts:
            return []
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = self.llm.generate(list(prompts), params, use_tqdm=progress)
        return [Completion(out.outputs[0].text, len(out.prompt_token_ids), out.num_cached_tokens) for out in outputs]

    def reset_prefix_cache(self) -> bool:
        """Empty the engine's prefix cache (between benchmark arms); whether vLLM did."""
        return bool(self.llm.reset_prefix_cache())


def vllm_backend(engine_args: Mapping[str, Any]) -> VLLMBackend:
    """A :class:`VLLMBackend` on a new ``vllm.LLM`` (``engine_args`` over :data:`ENGINE_DEFAULTS`), not shut down
    here: for a process that ends with the engine, such as a Ray actor."""
    from vllm import LLM

    return VLLMBackend(LLM(**{**ENGINE_DEFAULTS, **engine_args}))


@contextmanager
def started_vllm(model: str | os.PathLike[str], **engine_args: Any) -> Iterator[VLLMBackend]:
    """Start ``vllm.LLM`` on ``model`` with prefix caching on, give its backend, and shut the engine down after.

    ``engine_args`` are vLLM engine arguments (``block_size=32``, ``enforce_eager=True``, ...); they override
    the two set here, ``enable_prefix_caching=True`` and ``seed=0``.
    """
    backend = vllm_backend({"model": str(model), **engine_args})
    try:
        yield backend
    finally:
        vllm_0_32.shutdown_llm(backend.llm)
