"""Tiered store of encoded prompt modules (engine-free): GPU, host memory and disk, with eviction and prefetch.

An :class:`EncodedModule` is a module's KV cache for every layer, one tensor ``kv`` of shape
``[layers, 2, tokens, kv_heads, head_dim]`` (index 0 of the second axis holds keys, 1 values). Keys are kept as
encoded at the module's reference position ``start``; a splice at position ``p`` re-rotates them by
``p - start`` (:mod:`kvreuse.kernels.rerotate`), values carry no position.

Keys name everything the KV depends on. A module is stored under a :class:`ModuleKey`: its namespace
(:mod:`kvreuse.modules.namespace`: global, or a tenant's cache salt), its name, a fingerprint of what its KV was
computed from and with (:func:`module_fingerprint`: kvreuse's KV format version, model id, tokenizer id, the
module's token ids, the hash of the context it was encoded after, its start position, the recovery method applied
to it and the adapter the model ran with, e.g. a LoRA adapter) and a version.

A namespace binds each name to one content, its token ids, and holds one or more *encodings* of it: entries of the
same tokens computed after other contexts or with other adapters (``kvreuse.modules.encodings`` says which one a
prompt takes). Putting a name again with a fingerprint it holds keeps the stored entry (same key, same KV); with
the same tokens and another fingerprint it adds an encoding (the first one per adapter is the name's *primary*,
:meth:`ModuleStore.current`); with other tokens it is refused (:class:`ModuleConflict`) unless the put says
``replace=True``: the new entry then takes the name atomically (under the store's lock, no get sees neither), every
encoding stored under the name leaves, and the entry gets a new version. Versions come from one counter per store,
so no two entries a store ever held share one: KV computed from an old entry (an engine's prefix-cache blocks) can
be told apart from the new entry's by the key. A store serves one model and tokenizer; a module encoded for another
is refused with :class:`ModuleMismatch`. Encodings count against their namespace's quota like any entry.

Tiers, fastest first: the device tier (accelerator memory, labelled ``gpu`` on a CUDA device; tensors on
``ModulesConfig.gpu_device``), ``cpu`` (host tensors, pinned when ``pin_cpu_memory`` and CUDA is available) and
``disk`` (one safetensors file per module, written to a temporary file and renamed into place, in ``disk_dir`` or a
temporary folder). A tier of capacity 0 is off. The device tier's size is ``gpu_bytes`` or, by default (-1), the
budget the engine adapter carves out of the engine's own memory budget (``device_bytes``); without one it is off.
On a machine without CUDA a ``cuda`` device tier is off too: no host memory is passed off as a GPU tier. A device
tier placed on another device on purpose (``gpu_device="cpu"``: tests of the tier logic) is labelled ``device``.

The disk tier is a cache of this process, not a persistent store: files are deleted when their module leaves it
and on :meth:`ModuleStore.close`, and files found in ``disk_dir`` at start are not read. Invariants, after every
public call:

* each module lives in exactly one tier;
* the bytes of the modules in a tier (``EncodedModule.nbytes``; file headers not counted) never exceed the
  tier's capacity;
* a module is never returned with KV other than what was put: a disk file that is missing, unreadable, or whose
  contents differ from the checksum taken when it was written is a load failure; :meth:`ModuleStore.get` then
  returns ``None`` (the caller recomputes) and forgets the module.

A put goes to the fastest tier that can hold the module; a full tier moves its victims (chosen by the eviction
policy: ``lru``, ``lfu`` or ``fifo``) one tier down, and the last tier drops them. A get that finds the module in
a slower tier promotes it to the fastest tier that can hold it. The store owns the tensors it is given and those
it returns: callers must not write to them. All public methods take one lock, so a background prefetch thread
and the engine's thread can share the store.

Namespaces share the tiers, and two settings bound what one tenant can do to the others:

* ``namespace_bytes`` (a quota, 0 = none) bounds the bytes each tenant namespace holds, all tiers together: a
  tenant's put that would take its namespace past the quota first drops that namespace's own modules (chosen by
  the eviction policy), never another's; a module larger than the quota is refused (:class:`ModuleQuotaExceeded`).
  The global namespace has no quota (its writers are the operator's).
* ``protect_global`` (on by default): room for a tenant's module (a put, a promotion, and the demotions they set
  off) is never made by moving a global module, down a tier or out of the store; the module takes a slower tier
  that has room, or, if none has, a put is refused (:class:`ModuleQuotaExceeded`) and a promotion does not happen.

Below its quota, a tenant's modules compete with other tenants' for the tiers as before (the eviction policy
across namespaces): a quota bounds what a namespace holds, not what it can push out of a faster tier. Sizing
``namespace_bytes`` times the number of tenants within the tiers' capacity keeps tenants from pushing each other
out of the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvreuse.errors import (
    ConfigError,
    ModuleConflict,
    ModuleMismatch,
    ModuleQuotaExceeded,
    ModuleRegistrationError,
    ModuleTooLarge,
)
from kvreuse.kernels import SUPPORTED_DTYPES
from kvreuse.modules.config import AUTO, ModulesConfig
from kvreuse.modules.namespace import GLOBAL, namespace_label
from kvreuse.reorder.rerank import rerank_by_module_sets

logger = logging.getLogger("kvreuse.modules.store")

# Tier labels, fastest first, with their rank (the device tier is "gpu" on CUDA, "device" elsewhere).
TIER_RANK = {"gpu": 0, "device": 0, "cpu": 1, "disk": 2}
# kvreuse's layout of a module's KV ([layers, 2, tokens, kv_heads, head_dim], keys at `start`); part of every
# fingerprint, so KV stored by a kvreuse that laid it out differently is never taken for today's.
FORMAT_VERSION = 1
NO_RECOVERY = "none"  # the recovery method of a module spliced as it was encoded
MAX_LABEL_LENGTH = 64
NO_ADAPTER = ""  # the adapter of KV computed by the base model (kvreuse.modules.encodings.NO_ADAPTER)


def context_fingerprint(token_ids: Sequence[int]) -> str:
    """Hex digest of the token ids a module was encoded after (its attention saw them)."""
    return hashlib.sha256(json.dumps([int(t) for t in token_ids]).encode()).hexdigest()[:32]


NO_CONTEXT = context_fingerprint(())


def module_fingerprint(
    model_id: str,
    tokenizer_id: str,
    token_ids: Sequence[int],
    *,
    context: str = NO_CONTEXT,
    start: int = 0,
    recovery: str = NO_RECOVERY,
    adapter: str = NO_ADAPTER,
) -> str:
    """Hex digest of everything a module's KV depends on: kvreuse's KV format version, the model, the tokenizer,
    the token ids, the context's :func:`context_fingerprint`, the start position, the recovery method and the
    adapter the model ran with."""
    what = [
        FORMAT_VERSION,
        str(model_id),
        str(tokenizer_id),
        [int(t) for t in token_ids],
        context,
        start,
        recovery,
        adapter,
    ]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ModuleKey:
    """How the store finds a module: namespace, name, :func:`module_fingerprint` and the entry's version."""

    name: Hashable
    fingerprint: str
    namespace: str = GLOBAL
    version: int = 0

    @property
    def identity(self) -> str:
        """Hex digest of the whole key, for what must differ whenever the entry does (e.g. the extra keys of the
        prefix-cache blocks a splice produces, so a replaced entry's blocks never match again)."""
        what = json.dumps([self.namespace, repr(self.name), self.fingerprint, self.version])
        return hashlib.sha256(what.encode()).hexdigest()[:32]


@dataclass
class EncodedModule:
    """One module's KV cache for every layer, keys as encoded at token position ``start``.

    ``kv``: ``[layers, 2, tokens, kv_heads, head_dim]``, fp16, bf16 or fp32; ``kv[layer, 0]`` are keys,
    ``kv[layer, 1]`` values; ``tokens == len(token_ids)``. ``context``: :func:`context_fingerprint` of the tokens
    it was encoded after; ``recovery``: the method applied to its KV when spliced (plain data here, ``"none"``);
    ``adapter``: what the model ran with besides its weights (``""``: nothing; an engine adapter names a LoRA
    adapter here); ``namespace``: global or a tenant's; ``version``: set by :meth:`ModuleStore.put` (with ``key``).
    """

    name: Hashable
    model_id: str
    tokenizer_id: str
    token_ids: tuple[int, ...]
    start: int
    kv: torch.Tensor
    context: str = NO_CONTEXT
    recovery: str = NO_RECOVERY
    adapter: str = NO_ADAPTER
    namespace: str = GLOBAL
    version: int = 0
    key: ModuleKey = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = tuple(int(t) for t in self.token_ids)
        if not self.token_ids:
            raise ModuleRegistrationError(f"module {self.name!r} has no tokens")
        if isinstance(self.start, bool) or not isinstance(self.start, int) or self.start < 0:
            raise ModuleRegistrationError(f"module {self.name!r}: start must be a position >= 0, got {self.start!r}")
        kv = self.kv
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ModuleRegistrationError(
                f"module {self.name!r}: kv must be [layers, 2, tokens, kv_heads, head_dim], got {shape}"
            )
        if kv.shape[2] != len(self.token_ids):
            raise ModuleRegistrationError(
                f"module {self.name!r}: kv holds {kv.shape[2]} tokens but token_ids has {len(self.token_ids)}"
            )
        if kv.dtype not in SUPPORTED_DTYPES:
            raise ModuleRegistrationError(f"module {self.name!r}: kv dtype {kv.dtype} is not fp16, bf16 or fp32")
        for what, value in (("context", self.context), ("recovery", self.recovery)):
            if not isinstance(value, str) or not value or len(value) > MAX_LABEL_LENGTH:
                raise ModuleRegistrationError(
                    f"module {self.name!r}: {what} must be a string of 1-{MAX_LABEL_LENGTH} characters, got {value!r}"
                )
        if not isinstance(self.adapter, str) or len(self.adapter) > MAX_LABEL_LENGTH:
            raise ModuleRegistrationError(
                f"module {self.name!r}: adapter must be a string of at most {MAX_LABEL_LENGTH} characters"
            )
        if not isinstance(self.namespace, str):
            raise ModuleRegistrationError(f"module {self.name!r}: namespace must be a string (a cache salt)")
        fingerprint = module_fingerprint(
            self.model_id,
            self.tokenizer_id,
            self.token_ids,
            context=self.context,
            start=self.start,
            recovery=self.recovery,
            adapter=self.adapter,
        )
        self.key = ModuleKey(self.name, fingerprint, self.namespace, self.version)

    def _stamp(self, version: int) -> None:
        """Give the module the version its store entry has (and the key with it)."""
        self.version = version
        self.key = ModuleKey(self.key.name, self.key.fingerprint, self.key.namespace, version)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    def keys(self, layer: int) -> torch.Tensor:
        """``[tokens, kv_heads, head_dim]`` keys of ``layer``, at positions ``start, start + 1, ...``."""
        return self.kv[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        """``[tokens, kv_heads, head_dim]`` values of ``layer``."""
        return self.kv[layer, 1]


@dataclass
class StoreFigures:
    """Counters of a :class:`ModuleStore` since it was made (or since :meth:`ModuleStore.reset_figures`).

    ``hits[tier]``: gets answered from that tier; ``misses``: gets of unknown modules (load failures not
    included); ``moves["cpu->gpu"]`` and ``bytes_moved["cpu->gpu"]``: modules and bytes moved between tiers
    (promotions and demotions); ``evictions[tier]``: modules moved out of a tier to make room (demoted or, from
    the last tier, dropped); ``drops``: modules that left the store to make room; ``load_failures``: disk files
    that were missing, unreadable or corrupt; ``prefetched``: promotions made by :meth:`ModuleStore.prefetch`.
    """

    hits: Counter[str] = field(default_factory=Counter)
    misses: int = 0
    moves: Counter[str] = field(default_factory=Counter)
    bytes_moved: Counter[str] = field(default_factory=Counter)
    evictions: Counter[str] = field(default_factory=Counter)
    drops: int = 0
    load_failures: int = 0
    prefetched: int = 0

    def promotions(self, into: str = "gpu") -> int:
        """Modules moved up into tier ``into`` (from any slower tier)."""
        return sum(
            n
            for move, n in self.moves.items()
            if move.endswith(f"->{into}") and TIER_RANK[move.split("->")[0]] > TIER_RANK[into]
        )


@dataclass
class _Entry:
    nbytes: int
    entered: int  # tick at which the module entered this tier (fifo)
    module: EncodedModule | None = None  # memory tiers
    path: Path | None = None  # disk tier
    checksum: str = ""
    meta: dict[str, Any] | None = None  # disk tier: what is needed to rebuild the EncodedModule


@dataclass
class _Name:
    """What a name holds in its namespace: its token ids, every encoding stored under it, and the first one per
    adapter (its primary)."""

    token_ids: tuple[int, ...]
    keys: set[ModuleKey] = field(default_factory=set)
    primaries: dict[str, ModuleKey] = field(default_factory=dict)


@dataclass
class _Tier:
    name: str
    capacity: int
    device: torch.device | None  # None for disk
    entries: dict[ModuleKey, _Entry] = field(default_factory=dict)
    used: int = 0


def _checksum(kv: torch.Tensor) -> str:
    raw = kv.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.blake2b(raw.data, digest_size=16).hexdigest()


class ModuleStore:
    """Encoded modules of one model and tokenizer, in tiers device -> ``cpu`` -> ``disk`` (see the module doc).

    ``device_bytes``: the device tier's size when ``gpu_bytes`` is -1 (auto), given by the engine adapter out of
    the engine's memory budget; ``None``: no budget, the tier is off unless ``gpu_bytes`` sizes it.
    """

    def __init__(self, config: ModulesConfig, *, model_id: str, tokenizer_id: str, device_bytes: int | None = None):
        device = torch.device(config.gpu_device)
        device_capacity = config.gpu_bytes if config.gpu_bytes != AUTO else int(device_bytes or 0)
        if device.type == "cuda" and not torch.cuda.is_available():
            if device_capacity:
                logger.info("kvreuse modules: no CUDA device, so no gpu tier (modules.gpu_bytes does not apply)")
            device_capacity = 0
        if not (device_capacity or config.cpu_bytes or config.disk_bytes):
            raise ConfigError(
                "modules: every tier is off (no device tier: gpu_bytes is 0, auto without a budget, or there is no "
                "CUDA device; cpu_bytes and disk_bytes are 0); give cpu_bytes or disk_bytes a size"
            )
        self.config, self.model_id, self.tokenizer_id = config, str(model_id), str(tokenizer_id)
        self._pin = config.pin_cpu_memory and torch.cuda.is_available()
        self._owns_dir = False
        self._dir: Path | None = None
        if config.disk_bytes:
            if config.disk_dir:
                self._dir = Path(config.disk_dir)
                self._dir.mkdir(parents=True, exist_ok=True)
            else:
                self._dir, self._owns_dir = Path(tempfile.mkdtemp(prefix="kvreuse-modules-")), True
        all_tiers = [
            _Tier("gpu" if device.type == "cuda" else "device", device_capacity, device),
            _Tier("cpu", config.cpu_bytes, torch.device("cpu")),
            _Tier("disk", config.disk_bytes, None),
        ]
        self._tiers = [tier for tier in all_tiers if tier.capacity > 0]
        self._where: dict[ModuleKey, _Tier] = {}
        self._names: dict[tuple[str, Hashable], _Name] = {}  # (namespace, name) -> its content and encodings
        self._versions = 0  # the last version given to an entry
        self._uses: Counter[ModuleKey] = Counter()  # gets and puts per module (lfu)
        self._last: dict[ModuleKey, int] = {}  # tick of the last get or put (lru)
        self._tick = 0
        self._namespace_used: Counter[str] = Counter()  # bytes held per namespace, all tiers (namespace_bytes)
        self._lock = threading.RLock()
        self._executor: ThreadPoolExecutor | None = None
        self.figures = StoreFigures()

    # ---------------------------------------------------------------- public
    @property
    def tiers(self) -> tuple[str, ...]:
        """Names of the tiers that are on, fastest first."""
        return tuple(tier.name for tier in self._tiers)

    def current(self, name: Hashable, namespace: str = GLOBAL, adapter: str = NO_ADAPTER) -> ModuleKey | None:
        """The key of the entry that holds ``name`` in ``namespace`` for ``adapter`` now (its primary encoding: the
        first one stored since the name was bound), or ``None``."""
        with self._lock:
            bound = self._names.get((namespace, name))
            return None if bound is None else bound.primaries.get(adapter)

    def encodings(self, name: Hashable, namespace: str = GLOBAL) -> list[ModuleKey]:
        """Keys of every encoding stored under ``name`` in ``namespace``, oldest first."""
        with self._lock:
            bound = self._names.get((namespace, name))
            return [] if bound is None else sorted(bound.keys, key=lambda key: key.version)

    def put(self, module: EncodedModule, *, replace: bool = False) -> str:
        """Store ``module`` under its namespace and name in the fastest tier that can hold it; its tier name.

        The module is stamped with its entry's version (``module.version``, ``module.key``). The same name with a
        fingerprint it holds keeps the stored entry; the same tokens with another fingerprint (another context,
        start, recovery or adapter) add an encoding of the name; other tokens raise :class:`ModuleConflict` unless
        ``replace``, which swaps every encoding of the name for this entry atomically under a new version. Raises
        :class:`ModuleMismatch` for a module of another model or tokenizer and :class:`ModuleTooLarge` for one
        larger than every tier (nothing changes then).
        """
        for what, theirs, ours in (
            ("model", module.model_id, self.model_id),
            ("tokenizer", module.tokenizer_id, self.tokenizer_id),
        ):
            if str(theirs) != ours:
                raise ModuleMismatch(
                    f"module {module.name!r} was encoded for {what} {theirs!r}, but this store "
                    f"serves {what} {ours!r}; re-encode it with this {what}"
                )
        largest = max(tier.capacity for tier in self._tiers)
        if module.nbytes > largest:
            raise ModuleTooLarge(
                f"module {module.name!r} holds {module.nbytes} bytes of KV, more than any tier "
                f"({', '.join(f'{t.name}: {t.capacity}' for t in self._tiers)}); raise modules.gpu_bytes, "
                f"cpu_bytes or disk_bytes, or split the module"
            )
        quota = self._quota(module.namespace)
        if quota is not None and module.nbytes > quota:
            raise ModuleQuotaExceeded(
                f"module {module.name!r} holds {module.nbytes} bytes of KV, more than namespace "
                f"{namespace_label(module.namespace)} may hold (modules.namespace_bytes = {quota}); split the module"
            )
        with self._lock:
            binding = (module.namespace, module.name)
            bound = self._names.get(binding)
            same = next((k for k in bound.keys if k.fingerprint == module.key.fingerprint), None) if bound else None
            if same is not None and not replace:
                module._stamp(same.version)
                self._touch(same)
                return self._where[same].name
            if bound is not None and bound.token_ids != module.token_ids and not replace:
                raise ModuleConflict(
                    f"module {module.name!r} is already stored in namespace {namespace_label(module.namespace)} "
                    f"with other content (other tokens); replace it explicitly (replace=True) or register it under "
                    f"another name"
                )
            actor = module.namespace
            # Before anything changes (the entry it replaces is the actor's own, so counted as room already).
            if not any(self._has_room(tier, module.nbytes, actor) for tier in self._tiers):
                raise ModuleQuotaExceeded(
                    f"module {module.name!r} of namespace {namespace_label(actor)} ({module.nbytes} bytes) finds no "
                    f"tier with room: the rest is held by global modules, which tenants' modules never push out "
                    f"(modules.protect_global); raise the tiers' capacities"
                )
            if bound is not None and replace:
                for old in list(bound.keys):
                    self._remove(old)
                    self._forget(old)
            if quota is not None:
                self._make_quota_room(actor, module.nbytes, quota)
            self._versions += 1
            module._stamp(self._versions)
            self._touch(module.key)
            landed = self._insert(module, 0, source=None)
            assert landed is not None  # some tier had room for it, and making room takes nothing from there
            bound = self._names.setdefault(binding, _Name(module.token_ids))
            bound.keys.add(module.key)
            bound.primaries.setdefault(module.adapter, module.key)
            return landed

    def get(self, key: ModuleKey, *, use: bool = True) -> EncodedModule | None:
        """The module with ``key``, promoted to the fastest tier that can hold it, or ``None`` (recompute it).

        ``use``: the read is a use of the module (a splice): counted as a hit or a miss, and as a use by the
        eviction policy; ``False`` for kvreuse's own reads (a probe ranking the stored entry's tokens)."""
        with self._lock:
            tier = self._where.get(key)
            if tier is None:
                if use:
                    self.figures.misses += 1
                return None
            module = self._promote(key)
            if module is None:
                return None
            if use:
                self.figures.hits[tier.name] += 1
                self._touch(key)
            return module

    def __contains__(self, key: ModuleKey) -> bool:
        with self._lock:
            return key in self._where

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def tier_of(self, key: ModuleKey) -> str | None:
        """Name of the tier holding ``key``, or ``None``."""
        with self._lock:
            tier = self._where.get(key)
            return None if tier is None else tier.name

    def used_bytes(self) -> dict[str, int]:
        """Bytes of module KV held per tier that is on."""
        with self._lock:
            return {tier.name: tier.used for tier in self._tiers}

    def capacities(self) -> dict[str, int]:
        return {tier.name: tier.capacity for tier in self._tiers}

    def namespace_bytes(self, namespace: str = GLOBAL) -> int:
        """Bytes of module KV ``namespace`` holds, all tiers together (what ``modules.namespace_bytes`` bounds)."""
        with self._lock:
            return self._namespace_used[namespace]

    def evict(self, key: ModuleKey) -> bool:
        """Remove ``key`` from the store (all tiers); whether it was there."""
        with self._lock:
            if key not in self._where:
                return False
            self._remove(key)
            self._forget(key)
            return True

    def prefetch(self, keys: Iterable[ModuleKey], *, background: bool = True) -> Future[int]:
        """Promote the modules of the first ``prefetch_depth`` of ``keys``, in the order given, to the fastest tier.

        Runs on one background thread (calls queue behind each other) unless ``background`` is false; the future
        gives the number of modules promoted. Unknown keys are skipped; no hits or misses are counted, but a
        prefetched module counts as just used for ``lru`` (so the next prefetched one does not push it out).
        """
        wanted = list(keys)[: self.config.prefetch_depth]
        if not background:
            done: Future[int] = Future()
            done.set_result(self._prefetch(wanted))
            return done
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvreuse-prefetch")
            return self._executor.submit(self._prefetch, wanted)

    def prefetch_order(self, requests_module_sets: Sequence[Collection[ModuleKey]]) -> list[int]:
        """Request indices ordered so that consecutive requests share modules (``rerank_by_module_sets``).

        Fewer modules change between neighbours, so fewer are promoted and demoted when the requests run (and
        are prefetched) in this order.
        """
        ids: dict[ModuleKey, int] = {}
        sets = [[ids.setdefault(key, len(ids)) for key in modules] for modules in requests_module_sets]
        return [int(i) for i in rerank_by_module_sets(sets, len(ids))]

    def reset_figures(self) -> None:
        with self._lock:
            self.figures = StoreFigures()

    def close(self) -> None:
        """Stop the prefetch thread, forget every module and delete the disk tier's files."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        with self._lock:
            for key in list(self._where):
                self._remove(key)
            self._names.clear()
            if self._owns_dir and self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ModuleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- private
    def _touch(self, key: ModuleKey) -> None:
        self._tick += 1
        self._uses[key] += 1
        self._last[key] = self._tick

    def _prefetch(self, keys: list[ModuleKey]) -> int:
        promoted = 0
        for key in keys:
            with self._lock:
                tier = self._where.get(key)
                if tier is None or tier is self._tiers[0]:
                    continue
                self._tick += 1
                self._last[key] = self._tick  # about to be used: recent for lru, no use counted for lfu
                module = self._promote(key)
                if module is not None and self._where.get(key) is not tier:
                    promoted += 1
                    self.figures.prefetched += 1
        return promoted

    def _victim(self, keys: Collection[ModuleKey]) -> ModuleKey:
        """The one of ``keys`` (stored, not empty) the eviction policy moves first."""
        policy = self.config.eviction
        if policy == "fifo":
            return min(keys, key=lambda k: self._where[k].entries[k].entered)
        if policy == "lfu":
            return min(keys, key=lambda k: (self._uses[k], self._last.get(k, 0)))
        return min(keys, key=lambda k: self._last.get(k, 0))

    def _quota(self, namespace: str) -> int | None:
        """The bytes ``namespace`` may hold, or ``None`` (no quota: the global namespace, or quotas off)."""
        if namespace == GLOBAL or not self.config.namespace_bytes:
            return None
        return self.config.namespace_bytes

    def _movable(self, tier: _Tier, actor: str) -> list[ModuleKey]:
        """The modules of ``tier`` that room for a module of namespace ``actor`` may be made from."""
        if actor == GLOBAL or not self.config.protect_global:
            return list(tier.entries)
        return [key for key in tier.entries if key.namespace != GLOBAL]

    def _has_room(self, tier: _Tier, nbytes: int, actor: str) -> bool:
        """Whether ``tier`` can take ``nbytes`` for namespace ``actor``, moving only what it may move."""
        if tier.capacity < nbytes:
            return False
        free = tier.capacity - tier.used
        return free >= nbytes or free + sum(tier.entries[k].nbytes for k in self._movable(tier, actor)) >= nbytes

    def _make_quota_room(self, namespace: str, nbytes: int, quota: int) -> None:
        """Drop ``namespace``'s own modules (by the eviction policy) until ``nbytes`` more fit in its quota."""
        while self._namespace_used[namespace] + nbytes > quota:
            victim = self._victim([key for key in self._where if key.namespace == namespace])
            self.figures.evictions[self._where[victim].name] += 1
            self.figures.drops += 1
            logger.info(
                "kvreuse modules: %r leaves the store: namespace %s is at its quota (modules.namespace_bytes)",
                victim.name,
                namespace_label(namespace),
            )
            self._remove(victim)
            self._forget(victim)

    def _insert(self, module: EncodedModule, index: int, source: str | None) -> str | None:
        """Put ``module`` in tier ``index`` or, if it has no room for it, a slower one; demote victims (only those
        room for the module's namespace may be made from). Landing tier, or ``None`` where no tier has room."""
        actor = module.namespace
        while index < len(self._tiers) and not self._has_room(self._tiers[index], module.nbytes, actor):
            index += 1
        if index == len(self._tiers):
            return None
        tier = self._tiers[index]
        while tier.used + module.nbytes > tier.capacity:
            victim = self._victim(self._movable(tier, actor))
            self.figures.evictions[tier.name] += 1
            nbytes = tier.entries[victim].nbytes
            if not any(self._has_room(t, nbytes, victim.namespace) for t in self._tiers[index + 1 :]):
                self._remove(victim)  # no slower tier has room for it: it leaves the store
                self._forget(victim)
                self.figures.drops += 1
                continue
            moved = self._take(tier, victim)
            if moved is not None:  # None: a disk file that can no longer be read, counted as a load failure
                self._insert(moved, index + 1, source=tier.name)
        self._tick += 1
        if tier.device is None:
            entry = self._write(module, self._tick)
        else:
            entry = _Entry(module.nbytes, self._tick, module=self._on_device(module, tier))
        tier.entries[module.key] = entry
        tier.used += module.nbytes
        self._namespace_used[actor] += module.nbytes
        self._where[module.key] = tier
        if source is not None:
            move = f"{source}->{tier.name}"
            self.figures.moves[move] += 1
            self.figures.bytes_moved[move] += module.nbytes
        return tier.name

    def _promote(self, key: ModuleKey) -> EncodedModule | None:
        """Move ``key`` to the fastest tier with room for it (for a tenant's module, room that no protected global
        module holds; else it stays); the module, or ``None`` after a load failure."""
        tier = self._where[key]
        entry = tier.entries[key]
        target = next(
            i for i, t in enumerate(self._tiers) if t is tier or self._has_room(t, entry.nbytes, key.namespace)
        )
        if self._tiers[target] is tier:  # already as fast as it can be
            if entry.module is not None:
                return entry.module
            module = self._load(entry)
            if module is None:
                self._remove(key)
                self._forget(key)
            return module
        module = self._take(tier, key)
        if module is None:
            return None
        self._insert(module, target, source=tier.name)
        # target is faster than the tier it came from, so it is a memory tier and takes the module
        return self._where[key].entries[key].module

    def _take(self, tier: _Tier, key: ModuleKey) -> EncodedModule | None:
        """Remove ``key`` from ``tier`` and return its module (read from disk), or ``None`` on a load failure."""
        entry = tier.entries.pop(key)
        tier.used -= entry.nbytes
        self._namespace_used[key.namespace] -= entry.nbytes
        del self._where[key]
        if entry.module is not None:
            return entry.module
        module = self._load(entry)
        self._unlink(entry)
        if module is None:
            self._forget(key)
        return module

    def _forget(self, key: ModuleKey) -> None:
        """``key`` left the store for good: its use counts go, and its name with its last encoding. A primary that
        leaves is not replaced by another encoding (those are taken only where their context fits the prompt)."""
        self._uses.pop(key, None)
        self._last.pop(key, None)
        bound = self._names.get((key.namespace, key.name))
        if bound is None or key not in bound.keys:
            return
        bound.keys.discard(key)
        for adapter in [a for a, primary in bound.primaries.items() if primary == key]:
            del bound.primaries[adapter]
        if not bound.keys:
            del self._names[(key.namespace, key.name)]

    def _remove(self, key: ModuleKey) -> None:
        tier = self._where.pop(key)
        entry = tier.entries.pop(key)
        tier.used -= entry.nbytes
        self._namespace_used[key.namespace] -= entry.nbytes
        if entry.path is not None:
            self._unlink(entry)

    def _on_device(self, module: EncodedModule, tier: _Tier) -> EncodedModule:
        kv = module.kv
        if kv.device != tier.device:
            kv = kv.to(tier.device)
        if tier.name == "cpu" and self._pin and not kv.is_pinned():
            kv = kv.pin_memory()
        if kv is module.kv:
            return module
        return dataclasses.replace(module, kv=kv)

    def _write(self, module: EncodedModule, tick: int) -> _Entry:
        from safetensors.torch import save_file

        assert self._dir is not None
        kv = module.kv.detach().contiguous().cpu()
        meta = {
            "name": json.dumps(module.name),
            "model_id": module.model_id,
            "tokenizer_id": module.tokenizer_id,
            "token_ids": json.dumps(list(module.token_ids)),
            "start": str(module.start),
            "context": module.context,
            "recovery": module.recovery,
            "adapter": module.adapter,
            "namespace": module.namespace,
            "version": str(module.version),
            "fingerprint": module.key.fingerprint,
        }
        stem = hashlib.sha256(repr(module.key).encode()).hexdigest()[:40]
        path = self._dir / f"{stem}.safetensors"
        handle, tmp = tempfile.mkstemp(dir=self._dir, prefix=f".{stem}.", suffix=".tmp")
        os.close(handle)
        try:
            save_file({"kv": kv}, tmp, metadata=meta)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return _Entry(
            module.nbytes,
            tick,
            path=path,
            checksum=_checksum(kv),
            meta={**meta, "name": module.name, "shape": tuple(kv.shape), "dtype": kv.dtype},
        )

    def _load(self, entry: _Entry) -> EncodedModule | None:
        from safetensors import safe_open

        assert entry.path is not None and entry.meta is not None
        meta = entry.meta
        try:
            with safe_open(str(entry.path), framework="pt") as f:
                header = f.metadata() or {}
                kv = f.get_tensor("kv")
            if (
                header.get("fingerprint") != meta["fingerprint"]
                or tuple(kv.shape) != meta["shape"]
                or kv.dtype != meta["dtype"]
                or _checksum(kv) != entry.checksum
            ):
                raise ValueError("contents differ from what was written")
            module = EncodedModule(
                meta["name"],
                meta["model_id"],
                meta["tokenizer_id"],
                tuple(json.loads(meta["token_ids"])),
                int(meta["start"]),
                kv,
                context=meta["context"],
                recovery=meta["recovery"],
                adapter=meta["adapter"],
                namespace=meta["namespace"],
                version=int(meta["version"]),
            )
            if module.key.fingerprint != meta["fingerprint"]:
                raise ValueError("the file's module is not the one asked for")
            return module
        except Exception:  # missing, truncated, corrupt: never hand back wrong KV
            self.figures.load_failures += 1
            return None

    @staticmethod
    def _unlink(entry: _Entry) -> None:
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)
