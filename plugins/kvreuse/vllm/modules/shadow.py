"""Shadow checks in vLLM's offline API: every Nth request also computed with full prefill, its first tokens compared
in the engine (``kvreuse.modules.shadow``), counted on ``kvreuse:module_shadow_checks_total`` and
``kvreuse:module_shadow_agreed_total``.

Why the copy is sent by the client. A KV connector answers vLLM's questions about requests the scheduler already
holds (``get_num_new_matched_tokens``, ``request_finished``, ...); vLLM 0.32's connector interface has no way to add
a request, and a request the engine made up would have no client to return its output to. So the client sends
both halves (:class:`ShadowChecker` here, or any HTTP client with ``kv_transfer_params {"kvreuse_shadow": {"pair":
NAME, "full": ...}}``), and the engine's scheduler side pairs them when they finish and counts. The full half runs
in the same batches as the user's requests (vLLM schedules them together, so it delays them only by the compute it
adds), with ``max_tokens`` at most ``compare_tokens``; its output is not returned.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

from kvreuse.vllm.modules.common import SHADOW


class ShadowChecker:
    """Sends requests to ``llm`` (vLLM's ``LLM`` with the ``KVReuseModuleCache`` connector), every ``every``-th one
    with a full-prefill copy whose first ``compare_tokens`` tokens the engine compares with it."""

    def __init__(self, llm: Any, every: int, compare_tokens: int = 16) -> None:
        if every < 1 or compare_tokens < 1:
            raise ValueError(f"every ({every}) and compare_tokens ({compare_tokens}) must be at least 1")
        self.llm = llm
        self.every = every
        self.compare_tokens = compare_tokens
        self._sent = itertools.count()
        self._run = uuid.uuid4().hex[:12]  # pair names unique to this checker

    def generate(self, prompts: Sequence[Any], params: Any) -> list[Any]:
        """``llm.generate(prompts, params)`` (one ``SamplingParams`` for all) with the shadow copies added; the
        outputs of ``prompts`` only, in order."""
        all_prompts: list[Any] = []
        all_params: list[Any] = []
        for prompt in prompts:
            n = next(self._sent)
            if n % self.every:
                all_prompts.append(prompt)
                all_params.append(params)
                continue
            pair = f"{self._run}-{n}"
            all_prompts += [prompt, prompt]
            all_params += [self._half(params, pair, full=False), self._half(params, pair, full=True)]
        outputs = self.llm.generate(all_prompts, all_params, use_tqdm=False)
        return [out for out, p in zip(outputs, all_params) if not _is_full_half(p)]

    def _half(self, params: Any, pair: str, *, full: bool) -> Any:
        half = params.clone()
        extra = dict(half.extra_args or {})
        transfer = dict(extra.get("kv_transfer_params") or {})
        transfer[SHADOW] = {"pair": pair, "full": full}
        extra["kv_transfer_params"] = transfer
        half.extra_args = extra
        if full:
            half.skip_reading_prefix_cache = True
            half.max_tokens = min(half.max_tokens or self.compare_tokens, self.compare_tokens)
        return half


def _is_full_half(params: Any) -> bool:
    transfer = (params.extra_args or {}).get("kv_transfer_params") or {}
    return bool(transfer.get(SHADOW, {}).get("full", False))
