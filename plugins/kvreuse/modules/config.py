"""Settings of the ``modules`` plugin (the tiered store of encoded prompt modules, :mod:`kvreuse.modules.store`).

Capacities count the bytes of the stored KV tensors (``EncodedModule.nbytes``); a tier with capacity 0 is off.
The default keeps 8 GiB of modules in host memory, a device (GPU) tier only of the size the engine adapter carves
out of the engine's own memory budget (``gpu_bytes`` -1, auto: none on a machine without CUDA, and none until the
adapter passes a budget), and the disk tier off (it needs a size chosen for the machine's disk).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvreuse import config
from kvreuse.errors import ConfigError
from kvreuse.modules.agreement import Normaliser
from kvreuse.sparse.ape import MAX_SCALE, MAX_TEMPERATURE, MIN_SCALE, MIN_TEMPERATURE, check_ape


class EvictionPolicy(StrEnum):
    """Which module a full tier moves down first (``modules.eviction``)."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # least frequently used
    FIFO = "fifo"  # first in


EVICTION_POLICIES = tuple(EvictionPolicy)
AUTO = -1  # gpu_bytes: the device tier's size is the budget the engine adapter gives the store
MAX_BLEND_LAYERS = 1024  # blend_layers: more than any model's layer count (past the model's: the whole run)


@dataclass(frozen=True)
class ModulesConfig:
    """Settings of the module store; see the README's table of flags.

    In vLLM they are read from ``--additional-config '{"kvreuse": {"modules": {...}}}'`` or ``KVREUSE_MODULES_*``.
    """

    gpu_bytes: int = config.setting(
        AUTO,
        "store: bytes of module KV kept on the GPU (device) tier; -1 = what the engine adapter carves out of the "
        "engine's memory budget (none yet: off), 0 = off; no tier without CUDA",
        low=AUTO,
    )
    cpu_bytes: int = config.setting(8 * 1024**3, "store: bytes of module KV kept in host memory (0 = tier off)", low=0)
    disk_bytes: int = config.setting(
        0, "store: bytes of module KV kept as safetensors files in disk_dir (0 = tier off)", low=0
    )
    disk_dir: str = config.setting(
        "", "store: folder of the disk tier's files; empty = a fresh temporary folder removed on close"
    )
    eviction: EvictionPolicy = config.setting(
        EvictionPolicy.LRU,
        "store: which module a full tier moves down first: least recently used, least frequently used, or first in",
    )
    pin_cpu_memory: bool = config.setting(
        True, "store: pin the host tier's tensors (only when CUDA is available) for faster copies to the GPU"
    )
    prefetch_depth: int = config.setting(
        8,
        "store: most modules one prefetch call promotes, in the order given (0 = prefetch off)",
        low=0,
        high=config.MAX_TOKENS,
    )
    gpu_device: str = config.setting(
        "cuda", "store: torch device of the device tier; a cuda device without CUDA means no device tier"
    )
    namespace_bytes: int = config.setting(
        0,
        "store: bytes of module KV each tenant namespace (cache salt) may hold, all tiers together; a tenant's put "
        "past it drops that namespace's own modules (by eviction), never another's; a module larger is refused "
        "(0 = no quota; the global namespace has none)",
        low=0,
    )
    protect_global: bool = config.setting(
        True,
        "store: a tenant's modules (puts, promotions) never push a global module (written without a cache salt) "
        "down a tier or out of the store; they take a slower tier, or are refused, instead (false: global modules "
        "compete for room like any other)",
    )
    open_writes: bool = config.setting(
        False,
        "engine: take module writes that carry no write proof, i.e. let every client that can send "
        "kv_transfer_params register or replace modules (off: writes need the module-write key through the "
        "HTTP guard, or come from the offline API)",
    )
    index_bytes: int = config.setting(
        256 * 1024**2,
        "index: bytes the token index that finds modules in prompts may use (32 per registered token); "
        "a module past it is refused",
        low=0,
    )
    # 16: the best accuracy per compute measured on a trained model (README, "Answer quality of spliced modules":
    # 81% of full prefill's accuracy at 13% of its compute, TTFT still 4.4x below full prefill on 8 x 256 tokens;
    # issue 27's curves in the engine at 4 and 8 documents: 71% at 14-17%, as much as any recovery, the least compute).
    recompute_first: int = config.setting(
        16,
        "engine: tokens at the start of each spliced module computed afresh with the whole prompt before them "
        '(LegoLink); a request may set its own with kv_transfer_params {"kvreuse_recompute_first": K} '
        "(0 = none: spliced KV as encoded; vLLM only, SGLang's module cache ignores it)",
        low=0,
        high=config.MAX_TOKENS,
    )
    recompute_share: float = config.setting(
        0.0,
        "engine: share (0 to 1) of each spliced module's tokens computed afresh, those whose KV moved most when "
        "the module was encoded after a probe context (encode_modules(..., probe=...); CacheBlend's choice made "
        'at encode time); a request may set its own with kv_transfer_params {"kvreuse_recompute_share": R}; '
        "with recompute_first, the union (0 = none; a module encoded without a probe recomputes none)",
        low=0,
        high=1,
    )
    recompute_budget: float = config.setting(
        0.0,
        "engine: share (0 to 1) of a spliced run's module tokens computed afresh, one budget for the whole prompt: "
        "spent on the tokens that lack most of their context (later modules first) and, in probed modules, "
        "deviated most at encode time; a module whose KV is exact gets none (kvreuse.modules.splice."
        'budgeted_tokens); a request may set its own with kv_transfer_params {"kvreuse_recompute_budget": B}; '
        "with recompute_first and recompute_share, the union (0 = none)",
        low=0,
        high=1,
    )
    recompute_blend: float = config.setting(
        0.0,
        "engine: share (0 to 1) of a spliced run's module tokens whose KV is not a full prefill's, computed afresh "
        "as chosen from the request itself (CacheBlend): every such token is first computed through the first "
        "blend_layers layers with the prompt before it (its KV there, and on the next layer, becomes a full "
        "prefill's), ranked by how far its KV on the next layer lies from the spliced KV, and the top share is "
        "recomputed in every layer (kvreuse.modules.blend); one budget per prompt; a request may set its own with "
        'kv_transfer_params {"kvreuse_recompute_blend": R}; with recompute_first, recompute_share and '
        "recompute_budget, the union (0 = off); needs kvreuse's attention backend and a Llama-type model on one "
        "worker",
        low=0,
        high=1,
    )
    blend_layers: int = config.setting(
        1,
        "engine: layers computed for every spliced token before recompute_blend's choice (the exact first layers; "
        "1 = layer 0 alone, as CacheBlend); at least the model's layer count computes the whole run; a request may "
        'set its own with kv_transfer_params {"kvreuse_blend_layers": L}',
        low=1,
        high=MAX_BLEND_LAYERS,
    )

    ape_temperature: float = config.setting(
        1.0,
        "engine: attention temperature of the tokens after spliced modules on the modules' keys (APE: logits "
        'divided by it); a request may set its own with kv_transfer_params {"kvreuse_ape": {"temperature": T, '
        '"scale": S}}; needs kvreuse\'s attention backend on CPU (1 = off; bounds from the fp32 arithmetic it feeds, '
        "kvreuse/sparse/ape.py)",
        low=MIN_TEMPERATURE,
        high=MAX_TEMPERATURE,
    )
    ape_scale: float = config.setting(
        1.0,
        "engine: factor on the attention mass the tokens after spliced modules give the modules' keys (APE: "
        "log(scale) added to their logits; 1 = off)",
        low=MIN_SCALE,
        high=MAX_SCALE,
    )
    shadow_every: int = config.setting(
        0,
        "front end: every Nth request the API server takes that may splice (greedy or seeded, one sample, not a "
        "module write, a full prefill or a client's shadow half) is also sent with full prefill in the background "
        "(at most 16 tokens, output discarded), and the engine compares their first tokens where the request "
        "spliced modules: kvreuse:module_shadow_checks_total / _agreed_total (0 = off; vLLM only)",
        low=0,
        high=1_000_000,
    )

    shadow_normalise: str = config.setting(
        "",
        "engine: compare a shadow pair's outputs as texts after these normaliser steps, a JSON list of first-line, "
        'case, whitespace, regex:PATTERN, json:FIELD, sql (e.g. ["first-line", "case"]; kvreuse.modules.agreement); '
        "empty = the same tokens",
    )

    def __post_init__(self) -> None:
        try:
            check_ape(self.ape_temperature, self.ape_scale, "modules.ape_temperature / modules.ape_scale")
        except ValueError as why:
            raise ConfigError(
                f"{why} ({config.env_name('modules', 'ape_temperature')}, {config.env_name('modules', 'ape_scale')})"
            ) from None
        self.shadow_normaliser()  # refused at start, naming the step

    def shadow_normaliser(self) -> Normaliser | None:
        """``shadow_normalise`` parsed (``None`` where empty).

        Raises :class:`ConfigError` for a value that is not a JSON list of normaliser steps."""
        if not self.shadow_normalise:
            return None
        where = f"modules.shadow_normalise ({config.env_name('modules', 'shadow_normalise')})"
        try:
            steps = json.loads(self.shadow_normalise)
        except ValueError:
            raise ConfigError(f'{where} must be a JSON list of normaliser steps, e.g. ["first-line", "case"]') from None
        if not isinstance(steps, list):
            raise ConfigError(f"{where} must be a JSON list of normaliser steps, got {type(steps).__name__}")
        try:
            return Normaliser.parse(steps)
        except ConfigError as why:
            raise ConfigError(f"{where}: {why}") from None

    @property
    def ape(self) -> tuple[float, float]:
        """(ape_temperature, ape_scale)."""
        return (self.ape_temperature, self.ape_scale)

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> ModulesConfig:
        return config.load(cls, "modules", flags, environ)
