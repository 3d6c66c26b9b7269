"""Shadow checks in vLLM: every Nth request also computed with full prefill, its first tokens compared in the engine
(``kvreuse.modules.shadow``), counted on ``kvreuse:module_shadow_checks_total`` and
``kvreuse:module_shadow_agreed_total`` where the request spliced modules.

Who sends the copy. A KV connector answers vLLM's questions about requests the scheduler already holds
(``get_num_new_matched_tokens``, ``request_finished``, ...); vLLM 0.32's connector interface has no way to add a
request, and a request the engine made up would have no client to return its output to. So the copy is sent from
outside the engine core: by vLLM's API server with ``modules.shadow_every`` (:func:`server_halves`, through
``kvreuse.patches.vllm_0_32.shadow_requests``, the copy's output read and dropped in the background), offline by
:class:`ShadowChecker`, or by any HTTP client with ``kv_transfer_params {"kvreuse_shadow": {"pair": NAME, "full":
...}}``; the engine's scheduler side pairs the halves when they finish and counts. The full half runs in the same
batches as the user's requests (vLLM schedules them together, so it delays them only by the compute it adds), with
``max_tokens`` at most ``compare_tokens``; its output is not returned.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

from kvreuse.vllm.modules.common import ENCODE_MODULE, SHADOW

COMPARE_TOKENS = 16  # first output tokens a full-prefill copy computes for the comparison
_server_sent = itertools.count()  # requests modules.shadow_every counted in this API server process
_server_run = uuid.uuid4().hex[:12]  # pair names unique to this process


class ShadowChecker:
    """Sends requests to ``llm`` (vLLM's ``LLM`` with the ``KVReuseModuleCache`` connector), every ``every``-th one
    with a full-prefill copy whose first ``compare_tokens`` tokens the engine compares with it."""

    def __init__(self, llm: Any, every: int, compare_tokens: int = COMPARE_TOKENS) -> None:
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
            all_params += [
                half(params, pair, False, self.compare_tokens),
                half(params, pair, True, self.compare_tokens),
            ]
        outputs = self.llm.generate(all_prompts, all_params, use_tqdm=False)
        return [out for out, p in zip(outputs, all_params) if not _is_full_half(p)]


def half(params: Any, pair: str, full: bool, compare_tokens: int) -> Any:
    """A copy of ``params`` (vLLM's ``SamplingParams``) as one half of shadow pair ``pair``: the full half reads no
    prefix cache (vLLM then asks no connector) and computes at most ``compare_tokens`` tokens."""
    copy = params.clone()
    extra = dict(copy.extra_args or {})
    transfer = dict(extra.get("kv_transfer_params") or {})
    transfer[SHADOW] = {"pair": pair, "full": full}
    extra["kv_transfer_params"] = transfer
    copy.extra_args = extra
    if full:
        copy.skip_reading_prefix_cache = True
        copy.max_tokens = min(copy.max_tokens or compare_tokens, compare_tokens)
    return copy


def server_halves(params: Any, every: int) -> tuple[Any, Any] | None:
    """``modules.shadow_every`` in vLLM's API server: for every ``every``-th request that can be checked, the
    served request's parameters and its full-prefill copy's (:func:`half`), else ``None``.

    A request can be checked when its first tokens are the same on both paths unless the splice changed them:
    greedy or seeded, one sample (the halves of ``n`` samples would share one pair name), reading the prefix cache
    (a full prefill already computes everything), and neither a module write nor a half its client sent."""
    transfer = (params.extra_args or {}).get("kv_transfer_params") if hasattr(params, "extra_args") else None
    if (
        getattr(params, "n", 1) != 1
        or not (params.temperature == 0 or params.seed is not None)
        or params.skip_reading_prefix_cache
        or (isinstance(transfer, dict) and (ENCODE_MODULE in transfer or SHADOW in transfer))
    ):
        return None
    n = next(_server_sent)
    if n % every:
        return None
    pair = f"server-{_server_run}-{n}"
    return half(params, pair, False, COMPARE_TOKENS), half(params, pair, True, COMPARE_TOKENS)


def _is_full_half(params: Any) -> bool:
    transfer = (params.extra_args or {}).get("kv_transfer_params") or {}
    return bool(transfer.get(SHADOW, {}).get("full", False))
