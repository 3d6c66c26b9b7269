"""SGLang radix cache of the ``modules`` plugin (``--radix-cache-backend kvreuse_modules``): cached prompt modules
spliced into requests at any position.

SGLang lets a plugin replace the whole prefix cache (``register_radix_cache_backend``); this is SGLang's own
``RadixCache`` with two additions, both in the scheduler process, where the tree and the KV pool live:

* **Learning a module.** Every insertion into the tree (SGLang inserts a request's computed tokens after its prefill
  and when it finishes) is scanned for the registered modules (``kvreuse.modules.trie.ModuleTrie``, filled from
  ``KVREUSE_SGLANG_MODULES_FILE``). A module the store does not hold yet is copied out of SGLang's KV pool, every
  layer, into the store (``kvreuse.modules.store.ModuleStore``), its keys as encoded at the position it had there.
* **Using a module.** ``match_prefix`` first matches as SGLang does. Where that hit ends, the modules that follow
  in the request's tokens (``kvreuse.modules.splice.plan_splice``: the module covering the first uncached token,
  then every module right after it that the store holds, never the prompt's last token) are written into freshly
  allocated KV slots, keys re-rotated to the positions they take (``kvreuse.kernels.rerotate.move_keys``), and
  inserted into the tree under the request's own tokens; the match is then repeated and returns the longer hit.
  Spliced entries are ordinary tree nodes: later requests share them, and eviction frees them as any other.

Like the Prompt Cache design it follows, a spliced module's keys and values are those it had where it was learnt:
they attended to what preceded it there, not to what precedes it now. Requests whose modules are all learnt at the
start of a prompt (no context) get exactly the KV of the module alone. What SGLang does not let a plugin do: hand
the KV to the attention backend (the slots are written directly, so the module cache cannot be combined with
``--attention-backend kvreuse_sparse``, whose key sketch would miss them), or splice from HiCache's storage tier
(its look-ups are chained page hashes that stop at the first gap, so only prefixes are found).

Settings: ``KVREUSE_MODULES_*`` (``ModulesConfig``, the store's tiers) and ``KVREUSE_SGLANG_MODULES_FILE``. The
selective-recompute settings (``modules.recompute_first``, on by default, and ``modules.recompute_share``) are
vLLM's alone: SGLang's module cache recomputes no spliced token, and says so once in its log.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, InsertResult, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from kvreuse.errors import ConfigError
from kvreuse.kernels.rerotate import RopeSpec, check_rerotation, rope_spec_from_hf_config
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.splice import Piece, piece_kv, plan_splice
from kvreuse.modules.store import EncodedModule, ModuleStore, context_fingerprint
from kvreuse.modules.trie import ModuleTrie
from kvreuse.patches import sglang_0_5
from kvreuse.sglang.names import BackendName
from kvreuse.sglang.settings import SGLangConfig, read_modules_file

logger = logging.getLogger("sglang.plugins.kvreuse.module_cache")


class ModuleRadixCache(RadixCache):
    """SGLang's ``RadixCache`` that learns registered modules and splices them after a prefix hit."""

    def __init__(
        self,
        params: CacheInitParams,
        *,
        store: ModuleStore,
        rope: RopeSpec,
        modules: Sequence[tuple[Hashable, Sequence[int]]] = (),
    ) -> None:
        super().__init__(params)
        self.store = store
        self.rope = rope
        # the module-sets schedule policy reads it too
        self.module_trie = ModuleTrie(modules, budget_bytes=store.config.index_bytes)
        self._module_tokens = {name: tuple(ids) for name, ids in modules}
        self.spliced_tokens = 0  # prompt tokens taken from modules instead of computed
        self.learnt_modules = 0

    def add_module(self, name: Hashable, token_ids: Sequence[int]) -> None:
        """Register a module to learn and splice (as the modules file does)."""
        self.module_trie.add(name, token_ids)
        self._module_tokens[name] = tuple(int(t) for t in token_ids)

    # -- learning --------------------------------------------------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        result = super().insert(params)
        if not sglang_0_5.cache_disabled(self) and params.value is not None and len(self.module_trie):
            self._learn(params.key, params.value)
        return result

    def _learn(self, key: RadixKey, slots: torch.Tensor) -> None:
        ids = key.token_ids[: len(slots)]
        for match in self.module_trie.find(ids):
            if self.store.current(match.name) is not None:
                continue
            kv = self._read_kv(slots[match.start : match.end])
            self.store.put(  # keyed by what its KV attended to: the tokens before it in this request
                EncodedModule(
                    match.name,
                    self.store.model_id,
                    self.store.tokenizer_id,
                    self._module_tokens[match.name],
                    match.start,
                    kv,
                    context=context_fingerprint(ids[: match.start]),
                )
            )
            self.learnt_modules += 1

    def _read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        pool = sglang_0_5.cache_kv_pool(self)
        layers = sglang_0_5.pool_layers(pool)
        slots = slots.to(sglang_0_5.layer_kv_buffers(pool, layers[0])[0].device)
        return torch.stack(
            [torch.stack([buffer[slots] for buffer in sglang_0_5.layer_kv_buffers(pool, layer)]) for layer in layers]
        ).clone()

    # -- splicing --------------------------------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        if sglang_0_5.cache_disabled(self) or not len(self.module_trie):
            return result
        ids = params.key.token_ids
        hit = result.device_prefix_len
        pieces = plan_splice(self.module_trie.find(ids), hit, len(ids) - 1, self._available)
        page = sglang_0_5.cache_page_size(self)
        end = hit + (sum(piece.length for piece in pieces) // page) * page
        if end <= hit or not self._splice(params.key, result, pieces, end):
            return result
        return super().match_prefix(params)

    def _available(self, name: Hashable) -> bool:
        return self.store.current(name) is not None

    def _splice(self, key: RadixKey, result: MatchResult, pieces: list[Piece], end: int) -> bool:
        """Write the pieces' KV for tokens ``[hit, end)`` into new slots and insert them; False if it could not."""
        hit = result.device_prefix_len
        modules = {}
        for piece in pieces:
            module_key = self.store.current(piece.name)
            module = self.store.get(module_key) if module_key is not None else None
            if module is None:  # gone since the plan (a failed disk load): splice nothing, compute as usual
                return False
            modules[piece.name] = module
        slots = sglang_0_5.allocate_slots(self, end - hit)
        if slots is None:
            return False
        pool = sglang_0_5.cache_kv_pool(self)
        layers = sglang_0_5.pool_layers(pool)
        at = 0
        for piece in pieces:
            length = min(piece.length, end - hit - at)
            if length <= 0:
                break
            device = sglang_0_5.layer_kv_buffers(pool, layers[0])[0].device
            part = slots[at : at + length].to(device)
            for layer, (keys, values) in zip(layers, piece_kv(modules[piece.name], piece, self.rope, device, length)):
                sglang_0_5.write_pool_kv(pool, layer, part, keys, values)
            at += length
        prefix = sglang_0_5.node_slots(self, result.last_device_node).to(slots.device)
        inserted = super().insert(
            InsertParams(
                key=RadixKey(key.token_ids[:end], key.extra_key, cache_salt=key.cache_salt),
                value=torch.cat([prefix[:hit], slots]),
            )
        )
        if inserted.prefix_len > hit:  # another request inserted part of it meanwhile: ours are duplicates
            sglang_0_5.free_slots(self, slots[: inserted.prefix_len - hit])
        self.spliced_tokens += end - hit
        return True


def create_module_radix_cache(ctx: Any) -> ModuleRadixCache:
    """SGLang's radix-cache factory (``TreeCacheBuildContext`` -> cache) for ``--radix-cache-backend
    kvreuse_modules``; refuses the configurations it cannot serve, naming the flag."""
    args = ctx.server_args
    problems = [
        what
        for what, given in (
            ("--disable-radix-cache", ctx.disable_radix_cache),
            ("hierarchical caching (--enable-hierarchical-cache)", ctx.enable_hierarchical_cache),
            ("hybrid sliding-window or state-space models", ctx.is_hybrid_swa or ctx.is_hybrid_ssm),
            (
                f"--attention-backend {BackendName.SPARSE_ATTENTION} (spliced slots would have no key sketch)",
                BackendName.SPARSE_ATTENTION
                in (getattr(args, "attention_backend", None), getattr(args, "decode_attention_backend", None)),
            ),
            ("speculative decoding with EAGLE (bigram keys)", ctx.params.is_eagle),
            ("tensor parallelism (each rank would need the same splice)", ctx.tp_size > 1),
        )
        if given
    ]
    if problems:
        raise ConfigError(f"--radix-cache-backend {BackendName.MODULE_CACHE} does not support {', '.join(problems)}")
    hf_config = ctx.model_config.hf_config
    rope = check_rerotation(rope_spec_from_hf_config(hf_config.to_dict()))
    settings = SGLangConfig.load()
    modules = read_modules_file(settings.modules_file) if settings.modules_file else []
    modules_config = ModulesConfig.load()
    if modules_config.recompute_first or modules_config.recompute_share:
        # The settings are shared with vLLM, where they are on by default; here nothing can recompute a spliced token.
        logger.info(
            "kvreuse module cache: modules.recompute_first (%d) and modules.recompute_share (%s) do not apply in "
            "SGLang; spliced modules keep their KV as learnt (selective recompute runs in vLLM only)",
            modules_config.recompute_first,
            modules_config.recompute_share,
        )
    store = ModuleStore(
        modules_config,
        model_id=str(args.model_path),
        tokenizer_id=str(getattr(args, "tokenizer_path", None) or args.model_path),
    )
    logger.info("kvreuse module cache: %d modules registered, store tiers %s", len(modules), store.tiers)
    return ModuleRadixCache(ctx.params, store=store, rope=rope, modules=modules)
