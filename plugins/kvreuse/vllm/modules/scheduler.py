"""Scheduler side of the module-cache connector (``kvreuse.vllm.modules.connector``): which prompt tokens come from
modules.

It runs in vLLM's engine-core process and never touches KV. It knows the modules the workers hold (from their
per-step reports), finds them in new prompts with a :class:`~kvreuse.modules.trie.ModuleTrie`, plans each load
with :func:`~kvreuse.modules.splice.plan_splice`, turns the plan into slots once vLLM has allocated the request's
blocks, and asks the workers to store the module of every encode request once its prompt has been computed.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from kvreuse.errors import ConfigError, ModuleRegistrationError, UnsupportedPositionalEncoding
from kvreuse.kernels.rerotate import rope_spec_from_hf_config
from kvreuse.modules.splice import Piece, plan_splice, skipped_modules, token_slots
from kvreuse.modules.store import ModuleKey
from kvreuse.modules.trie import ModuleMatch, ModuleTrie
from kvreuse.patches import vllm_0_32
from kvreuse.vllm.modules.common import (
    LoadSpec,
    ModuleCacheMetadata,
    ModuleCacheWorkerMeta,
    SaveSpec,
    encode_request,
    marks_encode,
)
from kvreuse.vllm.names import ConnectorName

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.plugins.kvreuse")


class ModuleScheduler:
    """Everything the scheduler side knows: the modules the workers hold, the loads planned for waiting requests,
    the encode requests in flight."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ConfigError(
                f'{ConnectorName.MODULE_CACHE} needs "kv_load_failure_policy": "recompute" in --kv-transfer-config, so '
                f"that a module that cannot be loaded is computed instead (got {transfer.kv_load_failure_policy!r})"
            )
        self.block_size = vllm_config.cache_config.block_size
        self.enabled = True
        try:
            rope_spec_from_hf_config(vllm_config.model_config.hf_config.to_dict())
        except UnsupportedPositionalEncoding as why:
            self.enabled = False
            logger.error("kvreuse module cache is off for this model: %s", why)
        self.trie = ModuleTrie()
        self.available: set[ModuleKey] = set()
        self._matches: dict[str, list[ModuleMatch]] = {}
        self._plans: dict[str, list[Piece]] = {}  # asked about, not yet allocated
        self._loads: list[LoadSpec] = []  # allocated, for the next step's metadata
        self._encodes: dict[str, tuple[Hashable, int, tuple[int, ...]]] = {}  # req id -> name, context, prompt
        self.skipped: Counter[str] = Counter()  # modules found but not spliced, by reason (since take_stats)
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM (KVConnectorBase_V1.bind_kv_cache_manager)

    # -- vLLM's calls ---------------------------------------------------------------------------------------------
    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after ``num_computed_tokens`` that cached modules cover (side-effect free for vLLM)."""
        if not self.enabled or not self.available or marks_encode(request.kv_transfer_params):
            self._plans.pop(request.request_id, None)
            return 0
        prompt = request.prompt_token_ids or []
        matches = self._matches.get(request.request_id)
        first_look = matches is None
        if matches is None:
            matches = self._matches[request.request_id] = self.trie.find(prompt)
        stop = min(len(prompt), request.num_tokens) - 1  # vLLM computes at least the last token
        pieces = plan_splice(matches, num_computed_tokens, stop, self.available.__contains__)
        self._plans[request.request_id] = pieces
        if first_look:  # counted once per request (vLLM may ask again while it waits)
            misses = self.trie.near_misses(prompt, matches)
            available = self.available.__contains__
            for skip in skipped_modules(matches, pieces, num_computed_tokens, stop, available, misses):
                self.skipped[skip.reason] += 1
                logger.debug(
                    "kvreuse module %r at token %d of request %s not spliced: %s",
                    getattr(skip.name, "name", skip.name),
                    skip.start,
                    request.request_id,
                    skip.reason,
                )
        return sum(piece.length for piece in pieces)

    def allocated(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks and took ``num_external_tokens`` of the planned tokens."""
        rid = request.request_id
        pieces = self._plans.pop(rid, [])
        self._remember_encode(request)
        if num_external_tokens <= 0:
            return
        kept: list[Piece] = []
        left = num_external_tokens
        for piece in pieces:  # vLLM may take fewer tokens than offered
            if left <= 0:
                break
            take = min(piece.length, left)
            kept.append(Piece(piece.name, piece.offset, piece.prompt_start, take))
            left -= take
        if left:
            raise RuntimeError(
                f"{ConnectorName.MODULE_CACHE}: vLLM took {num_external_tokens} tokens of request {rid}, more "
                f"than the {num_external_tokens - left} planned"
            )
        slots = tuple(tuple(token_slots(block_ids, self.block_size, p.prompt_start, p.prompt_end)) for p in kept)
        blocks = tuple(tuple(sorted({s // self.block_size for s in piece_slots})) for piece_slots in slots)
        self._loads.append(LoadSpec(rid, tuple(kept), slots, blocks))

    def build_metadata(self, scheduler_output: SchedulerOutput) -> ModuleCacheMetadata:
        meta = ModuleCacheMetadata(loads=self._loads, saves=self._saves(scheduler_output))
        self._loads = []
        seen: set[ModuleKey] = set()
        for pieces in self._plans.values():  # requests still waiting: their modules are worth promoting now
            for piece in pieces:
                if piece.name not in seen:
                    seen.add(piece.name)
                    meta.prefetch.append(piece.name)
        return meta

    def _saves(self, scheduler_output: SchedulerOutput) -> list[SaveSpec]:
        """The encode requests whose prompt is complete after this step."""
        saves: list[SaveSpec] = []
        if not self._encodes:
            return saves
        progress = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        progress.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, computed in progress.items():
            encode = self._encodes.get(rid)
            if encode is None:
                continue
            name, context, prompt = encode
            if computed + scheduler_output.num_scheduled_tokens.get(rid, 0) < len(prompt):
                continue  # chunked prefill: the module is complete in a later step
            del self._encodes[rid]
            assert self.kv_cache_manager is not None, "vLLM binds the KV cache manager before the first step"
            block_ids = vllm_0_32.request_block_ids(self.kv_cache_manager, rid)
            saves.append(
                SaveSpec(
                    rid,
                    name,
                    prompt[context:],
                    context,
                    tuple(token_slots(block_ids, self.block_size, context, len(prompt))),
                )
            )
        return saves

    def worker_reported(self, report: ModuleCacheWorkerMeta) -> None:
        for key in report.dropped:  # first: a module encoded again comes back under a new version, same tokens
            self.trie.remove(key)
        for key, token_ids in report.stored.items():
            try:
                self.trie.add(key, token_ids)
            except ModuleRegistrationError as why:
                logger.error("kvreuse module %r is stored but cannot be found in prompts: %s", key.name, why)
                continue
            self.available.add(key)
            logger.info("kvreuse module %r (%d tokens) is cached", key.name, len(token_ids))
        self.available -= report.dropped
        for name, why in report.failed.items():
            logger.error("kvreuse module %r was not stored: %s", name, why)

    def take_stats(self) -> dict[str, int]:
        """The skipped-module counts since the last call, as stats keys ``splice_skipped:<reason>``."""
        stats = {f"splice_skipped:{reason}": count for reason, count in self.skipped.items() if count}
        self.skipped.clear()
        return stats

    def finished(self, request_id: str) -> None:
        for state in (self._matches, self._plans, self._encodes):
            state.pop(request_id, None)

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _remember_encode(self, request: Request) -> None:
        if not self.enabled or request.request_id in self._encodes or not marks_encode(request.kv_transfer_params):
            return
        prompt = tuple(request.prompt_token_ids or ())
        try:
            found = encode_request(request.kv_transfer_params, len(prompt))
        except ModuleRegistrationError as why:
            logger.error("kvreuse: request %s runs without encoding a module: %s", request.request_id, why)
            return
        if found is not None:
            self._encodes[request.request_id] = (found[0], found[1], prompt)
