"""Scheduler side of the module-cache connector (``kvreuse.vllm.modules.connector``): which prompt tokens come from
modules.

It runs in vLLM's engine-core process and never touches KV. It knows the modules the workers hold (from their
per-step reports), finds them in new prompts with a :class:`~kvreuse.modules.trie.ModuleTrie`, plans each load
with :func:`~kvreuse.modules.splice.plan_splice`, turns the plan into slots once vLLM has allocated the request's
blocks, and asks the workers to store the module of every encode request once its prompt has been computed.

Who sees what. A request sees the global modules and those of its own ``cache_salt`` (its namespace,
``kvreuse.modules.namespace``); a write goes to the namespace of the encode request's salt.

Who may write. An encode request is stored only if its ``kv_transfer_params`` carry a write proof under one of the
engine's keys (``kvreuse.modules.writes``): the module-write key (the HTTP guard adds the proof to the writes it
allowed) or the process tree's local secret (the offline API signs with it), unless the operator turned
``modules.open_writes`` on. The proof must name this very write (its prompt's token ids, name, context, namespace,
flags), be unexpired, and be new: its nonce is remembered until it expires, so a proof writes once. Other writes
are refused (logged, counted as ``writes_refused``) and the request runs as
a plain one. An allowed encode request never reads vLLM's prefix cache: when it arrives (``on_new_request``, before
vLLM's first look-up), the scheduler side sets the request's ``skip_reading_prefix_cache``.

Which KV a request gets. The plan depends on the prompt, the store's entries and the settings, never on what
else the engine runs: a request splices the run of adjacent stored modules that starts at its first token, each
module in the encoding it takes (``kvreuse.modules.encodings``: computed with the request's adapter, after the
prompt's own tokens where one was, else after a context that fits it), with the tokens its recovery recomputes;
every other token is computed, modules after free text too. vLLM computes a request from the end of its own prefix
hit, so the scheduler side offers the rest of that run from there (``splice.run_from``).

What vLLM's prefix cache may give. Blocks a splice filled enter vLLM's prefix cache like computed ones, and the
blocks after them were computed attending to that KV. So that none of them is ever given for another plan (an
entry replaced since, another tenant's, another adapter's encoding, other recomputed tokens), the first time vLLM
asks about a request the scheduler side folds, into the hash of every block holding tokens of its run, the
identity of each module's entry (``ModuleKey.identity``: namespace, name, fingerprint, version) and what is
recomputed in it (``vllm_0_32.fold_into_block_hashes``). The hashes of later blocks chain from these, so a prefix
hit holds blocks computed by the same plan: a replaced or dropped entry's blocks are never matched again (they age
out of vLLM's cache). If vLLM's hit used hashes the fold changed, or the folded hashes are in the cache beyond it,
the scheduler side answers "ask again" (``None``) once, so vLLM looks the request up with them: identical prompts
still share their spliced blocks. A request whose folded entries left the store while it waited is planned again.

Chunked prefill. vLLM may schedule fewer tokens than the rest of a prompt (other requests took the step's budget).
The run is then loaded as vLLM allocates its blocks, and the tokens it recomputes are computed in whichever steps
vLLM schedules them, each step's metadata carrying the run's recompute (the worker moves the step's scheduled
tokens to their positions): the same KV as in one step. vLLM caches full blocks when it allocates them, before
a later step computes their recomputed tokens: such blocks leave its prefix cache (``vllm_0_32.uncache_blocks``),
and a request admitted in the same step whose hit holds one waits a step. A run whose recompute
``modules.recompute_blend`` chooses is the exception: its pass runs over every spliced token with the prompt before
it, in the step that loads the run, so it needs the whole rest of the prompt in that step; where vLLM chunks such a
prompt, the run's first tokens are loaded plainly and vLLM computes the rest at its own positions (more recompute
than asked, never a wrong one), and the request's blocks from its first spliced one on leave the prefix cache as
they fill (their KV is not the plan their hashes name).

APE (``modules.ape_temperature`` / ``ape_scale``, ``kvreuse_ape`` per request) changes how the tokens after a
request's spliced modules attend to them, not the modules' KV: the scheduler side sends the modules' spans of every
scheduled request with APE in each step's metadata (whether its modules were loaded or found in vLLM's prefix
cache), and folds APE's setting into the hash of the block where the modules end (``_fold``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from kvreuse.config import TRUE_WORDS
from kvreuse.errors import ConfigError, ModuleRegistrationError, RequestParameterError, UnsupportedPositionalEncoding
from kvreuse.kernels.rerotate import rope_spec_from_hf_config
from kvreuse.modules.agreement import same_output
from kvreuse.modules.blend import blend_count, ranking
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.encodings import Choice, Encoding, EncodingMatch, choose_encoding
from kvreuse.modules.namespace import namespace_label, namespace_of
from kvreuse.modules.shadow import ShadowPairs
from kvreuse.modules.splice import (
    Piece,
    SkipReason,
    allot_first_tokens,
    block_modules,
    budget_positions,
    budgeted_tokens,
    chosen_tokens,
    first_tokens,
    merge_positions,
    plan_splice,
    run_from,
    skipped_modules,
    token_slots,
)
from kvreuse.modules.store import ModuleKey
from kvreuse.modules.trie import ModuleMatch, ModuleTrie
from kvreuse.modules.writes import ProofVerdict, SeenNonces, engine_write_keys
from kvreuse.patches import vllm_0_32
from kvreuse.sparse.ape import OFF, ApeSpans
from kvreuse.vllm.modules.common import (
    APE,
    BLEND_PASS,
    BlendSpec,
    LoadSpec,
    ModuleCacheMetadata,
    ModuleCacheWorkerMeta,
    ModuleWrite,
    SaveSpec,
    ape_setting,
    blend_layers,
    encode_request,
    kv_adapter,
    marks_encode,
    non_token_inputs,
    recompute_blend,
    recompute_budget,
    recompute_first,
    recompute_share,
    shadow_half,
    write_verdict,
)
from kvreuse.vllm.names import SPARSE_CPU_SWITCH, ConnectorName
from kvreuse.vllm.settings import kvreuse_flags

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.plugins.kvreuse")
BLEND_CHOICES = 4096  # recompute_blend choices remembered for identical requests (a run's chosen positions each)
T = TypeVar("T")  # an engine setting's value, as _own_setting reads it per request


class WriteRefusal(StrEnum):
    """Why an encode request's module was not stored (label of ``kvreuse:module_writes_refused_total``)."""

    UNPROVEN = ProofVerdict.UNPROVEN.value  # no proof of this write (its content, name, salt...) under an engine key
    EXPIRED = ProofVerdict.EXPIRED.value  # a proof of this write past its expiry
    REPLAYED = ProofVerdict.REPLAYED.value  # a proof of this write accepted before
    NONCES_FULL = ProofVerdict.NONCES_FULL.value  # more unexpired proofs than the engine remembers
    MALFORMED = "malformed"  # a bad name, context length or replace flag
    NON_TOKEN_INPUT = "non_token_input"  # multimodal inputs or prompt embeddings: KV not named by its token ids


@dataclass(frozen=True)
class _Look:
    """What the scheduler found in a waiting request's prompt and the plan it made of it (``ModuleScheduler._fold``):
    the run it splices (``run``: the adjacent stored modules from the prompt's first token), the entries folded
    into its block hashes from block ``first_block`` on, with the tokens per module it recomputes
    (``recompute_first``, allotted over the run as ``first``; ``recompute_share`` of each module's ``rankings``, as
    they were when folded; folded too), the tokens the run's one budget chose (``budgeted``:
    ``modules.recompute_budget``, by module start, token indices in the module; folded too), the modules whose KV is
    a full prefill's already (``exact``, by prompt position: nothing of them is recomputed), the modules its later
    tokens attend to with APE (its setting folded into the first block after them) and the encoding each module
    takes (``choices``)."""

    matches: list[ModuleMatch]
    run: tuple[Piece, ...]
    first_block: int
    folded: frozenset[ModuleKey]
    recompute_first: int = 0
    recompute_share: float = 0.0
    rankings: Mapping[Hashable, tuple[int, ...]] = field(default_factory=dict)  # by ModuleKey
    ape: ApeSpans | None = None  # the spliced run's modules and APE's setting, where APE is on
    first: Mapping[int, int] = field(default_factory=dict)  # module start -> first tokens (allot_first_tokens)
    exact: frozenset[int] = frozenset()  # starts of the run's modules whose encoding is exact here (encodings)
    budgeted: Mapping[int, tuple[int, ...]] = field(default_factory=dict)  # module start -> budgeted_tokens' choice
    choices: Mapping[int, Choice] = field(default_factory=dict)  # module start -> the encoding taken, how it fits
    # modules.recompute_blend: the tokens the worker chooses from the request's context (blend_count over the run's
    # inexact tokens, ``inexact`` of them), after ``blend_layers`` exact layers; folded too.
    blend_count: int = 0
    blend_layers: int = 1
    inexact: int = 0
    run_identity: str = ""  # _run_identity of the run (where vLLM caches prefixes): names the choice made over it

    def first_count(self, module_start: int) -> int:
        """The first tokens the module of the run at ``module_start`` recomputes (its allotment)."""
        return self.first.get(module_start, 0)

    def recompute(self, pieces: Sequence[Piece]) -> tuple[int, ...]:
        """Prompt positions of ``pieces`` to recompute: LegoLink's first tokens, as allotted, the encode-time
        choice and the run's budgeted choice, none of them in a module whose KV is exact."""
        first = first_tokens(pieces, {piece.module_start: self.first_count(piece.module_start) for piece in pieces})
        budgeted = budget_positions(pieces, self.budgeted)
        if not self.recompute_share:
            return merge_positions(first, budgeted) if budgeted else first
        inexact = [piece for piece in pieces if piece.module_start not in self.exact]
        return merge_positions(first, budgeted, chosen_tokens(inexact, self.rankings, self.recompute_share))

    def blend_candidates(self, pieces: Sequence[Piece]) -> tuple[int, ...]:
        """Prompt positions of ``pieces``' tokens whose spliced KV is not a full prefill's (the candidates of
        ``recompute_blend``'s choice); fewer than the run's (``inexact``) where vLLM's prefix hit ended past the
        run's first inexact token."""
        return tuple(
            position
            for piece in pieces
            if piece.module_start not in self.exact
            for position in range(piece.prompt_start, piece.prompt_end)
        )


@dataclass
class _Loading:
    """A request vLLM admitted with its planned run: the run from vLLM's hit (``pieces``), the positions in it
    that are recomputed, vLLM's count of computed tokens after the load (``start``: the run's end less the
    recomputed), the request's blocks as last seen and the prompt position up to which the run is loaded.

    A run with ``recompute_blend`` carries its ``blend`` (``start`` counts its chosen tokens too) and the prompt's
    length when admitted: it is loaded whole in the admitting step or plainly (``ModuleScheduler._loads``); a plain
    fallback keeps its blocks from ``uncache_from`` on out of vLLM's prefix cache (``uncached``: the blocks done so
    far) until the request finishes."""

    pieces: tuple[Piece, ...]
    recompute: tuple[int, ...]
    start: int
    block_ids: list[int]
    loaded: int
    blend: BlendSpec | None = None
    prompt_len: int = 0
    uncache_from: int | None = None
    uncached: int = 0


@dataclass(frozen=True)
class _Plan:
    """A waiting request's planned run and the positions in it that are recomputed rather than loaded."""

    pieces: list[Piece]
    recompute: tuple[int, ...] = ()
    blend: BlendSpec | None = None  # context_slots filled in once vLLM allocated the blocks

    @property
    def external(self) -> int:
        """The tokens offered to vLLM as computed."""
        chosen = self.blend.count if self.blend is not None else 0
        return sum(piece.length for piece in self.pieces) - len(self.recompute) - chosen


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
        self.vllm_config = vllm_config
        self.config = ModulesConfig.load(kvreuse_flags(vllm_config.additional_config, "modules"))
        self.write_keys = engine_write_keys()
        self.seen_proofs = SeenNonces()  # accepted write proofs, until they expire: each is good for one write
        self.block_size = vllm_config.cache_config.block_size
        self.enabled = True
        try:
            rope_spec_from_hf_config(vllm_config.model_config.hf_config.to_dict())
        except UnsupportedPositionalEncoding as why:
            self.enabled = False
            logger.error("kvreuse module cache is off for this model: %s", why)
        if not self.write_keys and not self.config.open_writes:
            logger.warning("kvreuse: no module-write key or local secret in the engine's environment; no writes")
        # The index holds each module once, as (namespace, name); the store may hold several encodings of it (other
        # contexts, other adapters: kvreuse.modules.encodings), one of which a prompt takes.
        self.trie = ModuleTrie(budget_bytes=self.config.index_bytes)
        self.names: dict[tuple[str, Hashable], set[ModuleKey]] = {}  # (namespace, name) -> its stored encodings
        self.encodings: dict[ModuleKey, Encoding] = {}
        self.available: set[ModuleKey] = set()
        # Probed modules: their tokens, most deviating first (kvreuse.modules.blend), for modules.recompute_share.
        self.rankings: dict[ModuleKey, tuple[int, ...]] = {}
        # ... and their per-token deviation itself, for modules.recompute_budget (splice.budgeted_tokens).
        self.scores: dict[ModuleKey, tuple[float, ...]] = {}
        self._unranked: set[ModuleKey] = set()  # modules without a ranking that a request asked for (logged once)
        self._looks: dict[str, _Look] = {}
        self._counted: set[str] = set()  # requests whose skipped modules were counted
        self._plans: dict[str, _Plan] = {}  # asked about, not yet allocated
        self._loading: dict[str, _Loading] = {}  # allocated, loading over one step or more (vLLM may chunk)
        # Requests allocated in the step being scheduled that recompute tokens: the hashes of their blocks that hold
        # a recomputed token, until the step's metadata says which ones that step computes (build_metadata).
        self._recomputing: dict[str, dict[int, Hashable]] = {}
        self._ape: dict[str, ApeSpans] = {}  # requests whose later tokens attend to their modules with APE
        self._blended: dict[str, tuple[int, int]] = {}  # requests whose load ran recompute_blend's pass: its size
        # recompute_blend's choices, by the run they were made over (_Look.run_identity), the latest BLEND_CHOICES
        self.blend_choices: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        # APE is applied by kvreuse's attention backend in PyTorch; the Triton kernels (CUDA) know no APE bias.
        self.applies_ape = applies_ape(vllm_config)
        if self.config.ape != OFF and not self.applies_ape:
            raise ConfigError(
                f"modules.ape_temperature / modules.ape_scale ({self.config.ape}) need kvreuse's attention backend "
                f"over vLLM's CPU build ({SPARSE_CPU_SWITCH}=1); this engine {NO_APE}"
            )
        # modules.recompute_blend's pass runs the model's first layers in the worker, over its own heads: one
        # worker holds every head and layer (a tensor- or pipeline-parallel engine would rank each share apart).
        self.blend_refusal = blend_refusal(vllm_config)
        if self.config.recompute_blend and self.blend_refusal:
            raise ConfigError(f"modules.recompute_blend ({self.config.recompute_blend}) {self.blend_refusal}")
        self.num_layers = int(vllm_config.model_config.hf_config.num_hidden_layers)
        self._writes: dict[str, ModuleWrite | None] = {}  # encode requests asked about: the write, None if refused
        self._encodes: dict[str, tuple[ModuleWrite, tuple[int, ...]]] = {}  # req id -> write, prompt
        self.skipped: Counter[str] = Counter()  # modules found but not spliced, by reason (since take_stats)
        self.taken: Counter[str] = Counter()  # encodings spliced into requests, by EncodingMatch (since take_stats)
        self.refused: Counter[str] = Counter()  # encode requests not stored, by WriteRefusal (since take_stats)
        self.shadows = ShadowPairs(same=self._shadow_comparison())  # finished halves waiting for the other half
        self._spliced: set[str] = set()  # requests that took KV from modules (a shadow check counts only for them)
        self.shadow_counts: Counter[str] = Counter()  # shadow_checks, shadow_agreed (since take_stats)
        self.kv_cache_manager: KVCacheManager | None = None  # bound by vLLM (KVConnectorBase_V1.bind_kv_cache_manager)

    # -- vLLM's calls ---------------------------------------------------------------------------------------------
    def arrived(self, request: Request) -> None:
        """A new request, before vLLM first looks it up: ``kv_transfer_params`` that are not an object are dropped
        (vLLM would fail on them); an encode request's write is decided, and an allowed one is computed without
        reading vLLM's prefix cache (vLLM reads the flag in that first look-up, so it is set here)."""
        if vllm_0_32.drop_malformed_transfer_params(request):
            logger.warning("kvreuse: request %s: kv_transfer_params is not an object; ignored", request.request_id)
        if self.enabled and marks_encode(request.kv_transfer_params):
            write = self._writes[request.request_id] = self._authorise(request)
            if write is not None:
                vllm_0_32.skip_prefix_cache_reads(request)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Prompt tokens after ``num_computed_tokens`` that cached modules cover, or ``None``: look the request up
        again (its block hashes changed, see the module docstring). Side-effect free for vLLM."""
        rid = request.request_id
        if marks_encode(request.kv_transfer_params):  # its write was decided on arrival; nothing is loaded
            self._plans.pop(rid, None)
            return 0
        look = self._looks.get(rid)
        ape = self._ape_setting(request) if look is None else OFF
        if ape != OFF and not self.applies_ape:
            self._plans.pop(rid, None)
            return 0  # refused (logged by _ape_setting): computed in full, never spliced without the asked APE
        if not self.enabled or (look is None and not self.available):
            self._plans.pop(rid, None)
            return 0
        prompt = request.prompt_token_ids or []
        if look is None and non_token_inputs(request):
            self._plans.pop(rid, None)
            self._refuse_non_token_inputs(request, prompt)
            return 0
        stop = min(len(prompt), request.num_tokens) - 1  # vLLM computes at least the last token
        if look is None or not look.folded <= self.available:  # new, or an entry it took left the store since
            if look is not None:
                ape = (look.ape.temperature, look.ape.scale) if look.ape is not None else self._ape_setting(request)
            matches, choices = self._find(request, prompt)
            look = self._looks[rid] = self._fold(
                request,
                matches,
                choices,
                stop,
                self._recompute_first(request),
                self._recompute_share(request),
                ape,
                self._recompute_budget(request),
                self._blend_setting(request),
            )
            if look.ape is not None:
                self._ape[rid] = look.ape
            else:
                self._ape.pop(rid, None)
            if look.folded and (
                num_computed_tokens > look.first_block * self.block_size  # vLLM's hit used hashes just changed
                or vllm_0_32.prefix_cache_hit(self.kv_cache_manager, request) > num_computed_tokens
            ):
                self._plans.pop(rid, None)
                return None
        if self._recomputing and self._reads_recomputed_blocks(request, num_computed_tokens):
            self._plans.pop(rid, None)
            return None  # its hit holds blocks a request admitted this step may recompute later: wait a step
        # What vLLM's prefix hit holds was computed by this same plan (the fold names it); the rest of the run is
        # loaded. A hit past the run leaves nothing to load: modules after it are computed, as the plan says.
        pieces = run_from(look.run, num_computed_tokens)
        fixed = look.recompute(pieces)
        blend = None
        if look.blend_count:
            candidates = look.blend_candidates(pieces)
            count = min(look.blend_count, len(set(candidates) - set(fixed)))
            if len(candidates) < look.inexact:
                # vLLM's hit holds inexact tokens of the run: an identical request's blocks (their hashes name the
                # run and the setting). Its choice was over the whole run: the rest recomputes what it chose there
                # (recorded from the worker's report), after the pass over the rest's candidates; unrecorded, the
                # rest of the run is computed.
                chosen = self.blend_choices.get(look.run_identity)
                if chosen is None:
                    self._plans.pop(rid, None)
                    return 0
                fixed = merge_positions(fixed, [p for p in chosen if p in set(candidates)])
                count = 0
            if count or len(candidates) > len(set(fixed) & set(candidates)):
                blend = BlendSpec(count, look.blend_layers, candidates, ())
        plan = self._plans[rid] = _Plan(pieces, fixed, blend)
        if rid not in self._counted:  # counted once per request (vLLM may ask again while it waits)
            self._counted.add(rid)
            self._count_skipped(request, prompt, look.matches, list(look.run), 0, stop)
        return plan.external

    def _reads_recomputed_blocks(self, request: Request, num_computed_tokens: int) -> bool:
        """Whether vLLM's prefix hit of ``request`` holds a block of a request admitted in this step that recomputes
        tokens in it (``_recomputing``): which of them that step computes is known only when the step is built."""
        pending = {block_hash for hashes in self._recomputing.values() for block_hash in hashes.values()}
        hit = vllm_0_32.request_block_hashes(request)[: num_computed_tokens // self.block_size]
        return any(block_hash in pending for block_hash in hit)

    def allocated(self, request: Request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM gave the request its blocks and took ``num_external_tokens`` of the planned tokens."""
        rid = request.request_id
        plan = self._plans.pop(rid, _Plan([]))
        write = self._writes.pop(rid, None)
        if write is not None:
            self._encodes[rid] = (write, tuple(request.prompt_token_ids or ()))
        if num_external_tokens <= 0:
            return
        self._spliced.add(rid)
        look = self._looks.get(rid)
        loaded = plan.pieces if num_external_tokens == plan.external else _first(plan.pieces, num_external_tokens, rid)
        if look is not None:
            for piece in loaded:
                choice = look.choices.get(piece.module_start)
                self.taken[choice.match if choice is not None else EncodingMatch.UNMATCHED] += 1
        if num_external_tokens != plan.external:
            # vLLM took fewer tokens than offered (it trims a hit to whole blocks on models kvreuse does not splice
            # into, hybrid ones): load the first ones; vLLM computes the rest of the run at its own positions.
            logger.warning(
                "kvreuse: vLLM took %d of the %d tokens planned for request %s", num_external_tokens, plan.external, rid
            )
            pieces = _first(plan.pieces, num_external_tokens, rid)
            self._loading[rid] = _Loading(tuple(pieces), (), 0, list(block_ids), pieces[0].prompt_start)
            return
        chosen = len(plan.recompute) + (plan.blend.count if plan.blend is not None else 0)
        start = plan.pieces[-1].prompt_end - chosen if chosen else 0
        blend = plan.blend
        if blend is not None:
            context = tuple(token_slots(block_ids, self.block_size, 0, plan.pieces[0].prompt_start))
            blend = replace(blend, context_slots=context)
        self._loading[rid] = _Loading(
            tuple(plan.pieces),
            plan.recompute,
            start,
            list(block_ids),
            plan.pieces[0].prompt_start,
            blend,
            request.num_tokens,
        )
        if plan.recompute or blend is not None:
            # vLLM cached this request's full blocks when it allocated them; until the step's metadata says which
            # of the recomputed tokens this step computes (and, with recompute_blend, whether the run is blended at
            # all), a request admitted after it in this step must not read them (matched_tokens asks it to wait).
            hashes = vllm_0_32.request_block_hashes(request)
            changed = plan.recompute + (blend.candidates if blend is not None else ())
            self._recomputing[rid] = {
                b: hashes[b] for b in sorted({p // self.block_size for p in changed}) if b < len(hashes)
            }

    def build_metadata(self, scheduler_output: SchedulerOutput) -> ModuleCacheMetadata:
        meta = ModuleCacheMetadata(loads=self._loads(scheduler_output), saves=self._saves(scheduler_output))
        scheduled = scheduler_output.num_scheduled_tokens
        meta.ape = {rid: spans for rid, spans in self._ape.items() if rid in scheduled}
        seen: set[ModuleKey] = set()
        for plan in self._plans.values():  # requests still waiting: their modules are worth promoting now
            for piece in plan.pieces:
                if piece.name not in seen:
                    seen.add(piece.name)
                    meta.prefetch.append(piece.name)
        return meta

    def _loads(self, scheduler_output: SchedulerOutput) -> list[LoadSpec]:
        """What this step writes into requests' blocks, and the recomputed tokens it computes.

        A run is loaded as its blocks are allocated: all of it in the step vLLM admits the request, unless vLLM
        chunks the prefill and allocates the run's last blocks in later steps (then each step loads what it
        allocated). The recomputed tokens are computed in the steps vLLM schedules them, wherever vLLM cuts the
        chunks: each step's ``LoadSpec`` carries the run's ``recompute`` and ``start``, and the worker moves that
        step's scheduled tokens to their positions (``true_positions``), so the KV is the plan's whatever else is
        scheduled. A block vLLM cached (it caches full blocks when it allocates them) that holds a recomputed token
        a later step computes is taken out of vLLM's prefix cache, so that no other request reads it before then
        (``vllm_0_32.uncache_blocks``; the request keeps it).

        A run with ``recompute_blend`` is loaded whole, with its pass, where vLLM schedules the rest of the prompt in
        the admitting step (:meth:`_blend_or_plain`)."""
        loads = []
        progress = _progress(scheduler_output)
        for rid, loading in list(self._loading.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)
            if not scheduled or rid not in progress:
                continue
            if self.kv_cache_manager is not None:  # vLLM allocates more blocks as it schedules more of the prompt
                loading.block_ids = vllm_0_32.request_block_ids(self.kv_cache_manager, rid)
            done = progress[rid] + scheduled  # vLLM's count of computed tokens after this step
            if loading.blend is not None:
                loads.append(self._blend_or_plain(rid, loading, done))
                if loading.blend is not None:  # blended in this step: nothing more to load or recompute
                    self._blended[rid] = (len(loading.blend.candidates), loading.blend.layers)
                    del self._loading[rid]
                    continue
            if loading.uncache_from is not None:
                self._uncache_fallback(loading, done)
                continue
            run_end = loading.pieces[-1].prompt_end
            allocated = min(run_end, len(loading.block_ids) * self.block_size)
            pieces = run_from(loading.pieces, loading.loaded, allocated)
            loads.append(self._load_spec(rid, pieces, loading.block_ids, loading.recompute, loading.start, None))
            loading.loaded = max(loading.loaded, allocated)
            pending = loading.recompute[max(0, done - loading.start) :] if loading.recompute else ()
            cached = {p // self.block_size for p in pending if p // self.block_size < done // self.block_size}
            if cached and self.kv_cache_manager is not None:
                vllm_0_32.uncache_blocks(self.kv_cache_manager, [loading.block_ids[b] for b in sorted(cached)])
            if loading.loaded >= run_end and not pending:
                del self._loading[rid]
        self._recomputing.clear()
        return loads

    def _blend_or_plain(self, rid: str, loading: _Loading, done: int) -> LoadSpec:
        """The admitting step's load of a run with ``recompute_blend``: the whole run with its pass where the step
        computes the rest of the prompt (``done``: vLLM's count after the step); else (chunked prefill) the plain
        load of its first ``loading.start`` tokens, and vLLM computes the rest at its own positions (more recompute
        than asked, never a wrong one): the pass would need the rest's tokens computed in this step. The fallback's
        blocks from the first one holding a candidate hold KV the plan their hashes name does not give, so they
        leave vLLM's prefix cache as they fill (``_uncache_fallback``)."""
        assert loading.blend is not None
        pieces = list(loading.pieces)
        if done >= loading.prompt_len:
            return self._load_spec(rid, pieces, loading.block_ids, loading.recompute, loading.start, loading.blend)
        first = _first(pieces, loading.start - pieces[0].prompt_start, rid)
        candidates = loading.blend.candidates
        loading.uncache_from = min(candidates) // self.block_size if candidates else len(loading.block_ids)
        loading.blend, loading.recompute = None, ()
        return self._load_spec(rid, first, loading.block_ids, (), 0, None)

    def _load_spec(
        self,
        rid: str,
        pieces: list[Piece],
        block_ids: Sequence[int],
        recompute: tuple[int, ...],
        start: int,
        blend: BlendSpec | None,
    ) -> LoadSpec:
        slots = tuple(tuple(token_slots(block_ids, self.block_size, p.prompt_start, p.prompt_end)) for p in pieces)
        blocks = tuple(tuple(sorted({s // self.block_size for s in piece_slots})) for piece_slots in slots)
        return LoadSpec(rid, tuple(pieces), slots, blocks, recompute, start, blend)

    def _uncache_fallback(self, loading: _Loading, done: int) -> None:
        """Take the blocks of a plainly loaded ``recompute_blend`` run that vLLM cached, from ``uncache_from`` to
        the last one full after this step (``done`` tokens), out of its prefix cache: their hashes name the blend's
        plan, and every later block chains from them."""
        assert loading.uncache_from is not None
        first = max(loading.uncache_from, loading.uncached)
        full = min(done // self.block_size, len(loading.block_ids))
        if full > first and self.kv_cache_manager is not None:
            vllm_0_32.uncache_blocks(self.kv_cache_manager, loading.block_ids[first:full])
        loading.uncached = max(loading.uncached, full)

    def _saves(self, scheduler_output: SchedulerOutput) -> list[SaveSpec]:
        """The encode requests whose prompt is complete after this step."""
        saves: list[SaveSpec] = []
        if not self._encodes:
            return saves
        for rid, computed in _progress(scheduler_output).items():
            encode = self._encodes.get(rid)
            if encode is None:
                continue
            write, prompt = encode
            if computed + scheduler_output.num_scheduled_tokens.get(rid, 0) < len(prompt):
                continue  # chunked prefill: the module is complete in a later step
            del self._encodes[rid]
            assert self.kv_cache_manager is not None, "vLLM binds the KV cache manager before the first step"
            block_ids = vllm_0_32.request_block_ids(self.kv_cache_manager, rid)
            saves.append(
                SaveSpec(
                    rid,
                    write.name,
                    prompt[write.context :],
                    write.context,
                    tuple(token_slots(block_ids, self.block_size, write.context, len(prompt))),
                    context=prompt[: write.context],
                    adapter=write.adapter,
                    namespace=write.namespace,
                    replace=write.replace,
                    probe=write.probe,
                )
            )
        return saves

    def worker_reported(self, report: ModuleCacheWorkerMeta) -> None:
        for key in report.dropped:  # first: a module encoded again comes back under a new version, same tokens
            self.available.discard(key)
            self.encodings.pop(key, None)
            self.rankings.pop(key, None)
            self.scores.pop(key, None)
            ref = (key.namespace, key.name)
            keys = self.names.get(ref)
            if keys is not None and key in keys:
                keys.discard(key)
                if not keys:  # its last encoding: the module leaves the index
                    del self.names[ref]
                    self.trie.remove(ref, namespace=key.namespace)
        for key, token_ids in report.stored.items():
            ref = (key.namespace, key.name)
            if ref not in self.names:
                try:
                    self.trie.add(ref, token_ids, namespace=key.namespace)
                except ModuleRegistrationError as why:  # ModuleIndexFull too
                    logger.error("kvreuse module %r is stored but cannot be found in prompts: %s", key.name, why)
                    continue
                self.names[ref] = set()
            self.names[ref].add(key)
            self.encodings[key] = report.placed[key]
            self.available.add(key)
            logger.info(
                "kvreuse module %r of namespace %s (%d tokens) is cached",
                key.name,
                namespace_label(key.namespace),
                len(token_ids),
            )
        for rid, chosen in report.blended.items():
            look = self._looks.get(rid)
            if look is not None and look.run_identity:
                self.blend_choices[look.run_identity] = chosen
                self.blend_choices.move_to_end(look.run_identity)
                while len(self.blend_choices) > BLEND_CHOICES:
                    self.blend_choices.popitem(last=False)
        self.available -= report.dropped
        for key, scores in report.scores.items():
            if key in self.available:
                self.rankings[key] = ranking(scores)
                self.scores[key] = tuple(scores)
                self._unranked.discard(key)
        for name, why in report.failed.items():
            logger.error("kvreuse module %s was not stored: %s", name, why)

    def _shadow_comparison(self) -> Callable[[Sequence[int], Sequence[int]], bool] | None:
        """How a shadow pair's outputs are compared: with ``modules.shadow_normalise``, as texts after it (the model's
        tokenizer, loaded in the engine core for it), else token for token (``None``)."""
        normaliser = self.config.shadow_normaliser()
        if normaliser is None:
            return None
        tokenizer = vllm_0_32.engine_tokenizer(self.vllm_config)
        return lambda full, served: same_output(full, served, normaliser, tokenizer.decode)

    def take_stats(self) -> dict[str, int]:
        """The skipped-module, refused-write and shadow-check counts since the last call, as stats keys
        ``splice_skipped:<reason>``, ``writes_refused:<reason>``, ``shadow_checks`` and ``shadow_agreed``."""
        stats = {f"splice_skipped:{reason}": count for reason, count in self.skipped.items() if count}
        stats.update({f"writes_refused:{reason}": count for reason, count in self.refused.items() if count})
        stats.update({f"encodings_taken:{match}": count for match, count in self.taken.items() if count})
        stats.update({name: count for name, count in self.shadow_counts.items() if count})
        self.skipped.clear()
        self.refused.clear()
        self.taken.clear()
        self.shadow_counts.clear()
        return stats

    def shadow_finished(self, request: Request) -> None:
        """``request`` finished: if it is half of a shadow check whose other half finished already, count the check
        and whether their output tokens agreed (``kvreuse.modules.shadow``). A served half that took no KV from
        modules (none in its prompt, or all recomputed) is compared as empty, so its pair is no check: both halves
        computed the prompt in full."""
        try:
            half = shadow_half(request.kv_transfer_params)
        except RequestParameterError:  # refused by vLLM's front end; a request that came another way is no check
            return
        if half is None:
            return
        tokens = request.output_token_ids if half[1] or request.request_id in self._spliced else ()
        agreed = self.shadows.finished(half[0], half[1], tokens)
        if agreed is not None:
            self.shadow_counts["shadow_checks"] += 1
            self.shadow_counts["shadow_agreed"] += agreed

    def finished_params(self, request_id: str) -> dict[str, dict[str, int]] | None:
        """What the finished request's output reports in its ``kv_transfer_params``: the size of the pass its
        ``recompute_blend`` ran (``{BLEND_PASS: {"tokens": T, "layers": L}}``: T spliced tokens through the first L
        layers and the next one's keys and values, work vLLM's count of computed tokens leaves out), else nothing."""
        if request_id not in self._blended:
            return None
        tokens, layers = self._blended[request_id]
        return {BLEND_PASS: {"tokens": tokens, "layers": layers}}

    def finished(self, request_id: str) -> None:
        for state in (
            self._looks,
            self._plans,
            self._writes,
            self._encodes,
            self._loading,
            self._recomputing,
            self._ape,
            self._blended,
        ):
            state.pop(request_id, None)
        self._counted.discard(request_id)
        self._spliced.discard(request_id)

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _find(self, request: Request, prompt: Sequence[int]) -> tuple[list[ModuleMatch], dict[int, Choice]]:
        """The modules of the global namespace and of the request's in its prompt, each named by the stored encoding
        it takes (``kvreuse.modules.encodings.choose_encoding``: the request's adapter, its context in this
        prompt), with that choice by module start. A module without an encoding for the request's adapter keeps
        its index name: no store entry has it, so it is not spliced (and ends the run before it)."""
        adapter = kv_adapter(request)
        matches, choices = [], {}
        for match in self.trie.find(prompt, namespace=namespace_of(request.cache_salt)):
            stored = (self.encodings[key] for key in self.names.get(match.name, ()))
            choice = choose_encoding(stored, prompt, match.start, adapter)
            if choice is None:
                matches.append(match)
                continue
            matches.append(ModuleMatch(choice.key, match.start, match.end))
            choices[match.start] = choice
        return matches, choices

    def _refuse_non_token_inputs(self, request: Request, prompt: Sequence[int]) -> None:
        """Count (once per request) the modules of a request whose model inputs are more than its token ids
        (multimodal data, prompt embeddings): their KV is not what the token ids name, so none is spliced."""
        if request.request_id in self._counted:
            return
        self._counted.add(request.request_id)
        found = self.trie.find(prompt, namespace=namespace_of(request.cache_salt))
        if found:
            self.skipped[SkipReason.NON_TOKEN_INPUT] += len(found)
            logger.info(
                "kvreuse: request %s carries %s; its %d modules are computed, not spliced",
                request.request_id,
                non_token_inputs(request),
                len(found),
            )

    @staticmethod
    def _own_setting(request: Request, read: Callable[[object, T], T], default: T, setting: str) -> T:
        """``request``'s own value of an engine setting, read from its ``kv_transfer_params`` by ``read``, else
        ``default`` (the engine's): also where its own is malformed, which is logged under ``setting``'s name.
        (vLLM's front end refuses such a request with a 400 before it gets here, ``check_transfer_params``; this
        is for a request that reached the engine another way.)"""
        try:
            return read(request.kv_transfer_params, default)
        except RequestParameterError as why:
            logger.error("kvreuse: request %s splices with %s: %s", request.request_id, setting, why)
            return default

    def _recompute_first(self, request: Request) -> int:
        """The tokens per spliced module ``request`` recomputes (its own setting, else the engine's)."""
        return self._own_setting(request, recompute_first, self.config.recompute_first, "modules.recompute_first")

    def _recompute_share(self, request: Request) -> float:
        """The share of each spliced module's ranked tokens ``request`` recomputes (its own, else the engine's)."""
        return self._own_setting(request, recompute_share, self.config.recompute_share, "modules.recompute_share")

    def _recompute_budget(self, request: Request) -> float:
        """The share of the spliced run's module tokens ``request`` recomputes under one budget (its own, else the
        engine's)."""
        return self._own_setting(request, recompute_budget, self.config.recompute_budget, "modules.recompute_budget")

    def _blend_setting(self, request: Request) -> tuple[float, int]:
        """``request``'s (recompute_blend, blend_layers): its own, else the engine's."""
        share = self._own_setting(request, recompute_blend, self.config.recompute_blend, "modules.recompute_blend")
        layers = self._own_setting(request, blend_layers, self.config.blend_layers, "modules.blend_layers")
        return share, layers

    def _rankings(self, request: Request, matches: list[ModuleMatch], share: float) -> dict[Hashable, tuple[int, ...]]:
        """The encode-time rankings of the modules of ``matches`` (none when ``share`` is 0); a module without one
        (encoded without a probe) is logged once and recomputes by ``recompute_first`` alone."""
        if not share:
            return {}
        found: dict[Hashable, tuple[int, ...]] = {}
        for match in matches:
            if match.name in self.rankings:
                found[match.name] = self.rankings[match.name]
            elif match.name in self.available and match.name not in self._unranked:
                self._unranked.add(match.name)
                logger.warning(
                    "kvreuse module %r has no token choice (encoded without a probe: encode_modules(..., probe=...)); "
                    "request %s recomputes none of its tokens by modules.recompute_share",
                    getattr(match.name, "name", match.name),
                    request.request_id,
                )
        return found

    def _ape_setting(self, request: Request) -> tuple[float, float]:
        """APE's (temperature, scale) for ``request``: its own setting, else (also where its own is malformed,
        logged) the engine's. A setting other than ``OFF`` on an engine that cannot apply APE is logged as an error
        (the caller then splices nothing into the request)."""
        ape = self._own_setting(request, ape_setting, self.config.ape, "modules.ape_temperature / ape_scale")
        if ape != OFF and not self.applies_ape:
            logger.error(
                "kvreuse: request %s asks for APE (%s %s) but this engine %s; its modules are not spliced (the "
                "prompt is computed in full)",
                request.request_id,
                APE,
                ape,
                NO_APE,
            )
        return ape

    def _fold(
        self,
        request: Request,
        matches: list[ModuleMatch],
        choices: Mapping[int, Choice],
        stop: int,
        recompute: int,
        share: float = 0.0,
        ape: tuple[float, float] = OFF,
        budget: float = 0.0,
        blend: tuple[float, int] = (0.0, 1),
    ) -> _Look:
        """The request's plan, and its entries folded into the request's block hashes (module doc).

        The plan depends on the prompt, the store's entries and the settings only, never on vLLM's prefix hit
        (which depends on what other requests left in the cache): the request splices the run of adjacent stored
        modules that starts at its first token, up to ``stop`` (``plan_splice`` from 0), each with the encoding
        it takes (``choices``); every other token is computed, modules after free text too. The entries of the run
        are folded into the hashes of the blocks holding its tokens, with ``recompute`` and ``share`` where they
        are not 0 (with the ranking of each module in the block): blocks whose spliced KV was partly recomputed
        differ from those of a plain splice or of another choice, so none may be given for another, and every
        later block chains from them. A prefix hit in vLLM's cache was therefore computed by this same plan.

        With APE on, the modules it applies to are the run less a module at the prompt's start (nothing precedes
        it, so its KV is a prefill's: APE's shared prefix).
        APE changes no module's KV, only that of the tokens after the run, so APE's setting (and the spans) is
        folded into the block holding the first of them: blocks of module tokens alone stay shared with plain
        splices, and every block from there on (its hash chains) is told apart from a plain splice's and another
        setting's.

        ``recompute`` first tokens per module are allotted over that same run (``allot_first_tokens``): a module
        whose encoding is exact here (``choices``: encoded after the prompt's own tokens before it, at its position,
        ``kvreuse.modules.encodings``) recomputes none, the others share its budget. Each module's count is folded
        into its blocks, and so is the choice of ``budget`` (``budgeted_tokens``, over the same run) in each
        module.

        ``blend`` (recompute_blend, blend_layers) counts the tokens the worker chooses over the run's inexact
        tokens from the request's own context (``kvreuse.modules.blend.blend_count``; all of them at
        ``blend_layers`` past the model's layers). That choice depends on every token of the run and on every
        other choice in it, so the blocks holding inexact tokens are folded with the setting and the whole run's
        identity (``_run_identity``): only a request with the same run, settings and prefix (the hashes chain) gets
        them. An engine that cannot run the pass (``blend_refusal``) gets no splice for such a request: it is
        computed in full, never spliced without the asked recompute."""
        rankings = self._rankings(request, matches, share)
        run = plan_splice(matches, 0, stop, self.available.__contains__)
        exact = frozenset(start for start, choice in choices.items() if choice.exact)
        first = allot_first_tokens(run, recompute, lambda piece: piece.module_start in exact)
        budgeted = (
            budgeted_tokens(run, budget, lambda piece: piece.module_start in exact, self.scores) if budget else {}
        )
        num_blocks = request.num_tokens // self.block_size
        share_blend, layers = blend
        inexact = sum(piece.length for piece in run if piece.module_start not in exact)
        count = 0
        if share_blend:
            if self.blend_refusal:
                logger.error(
                    "kvreuse: request %s asks for recompute_blend %s but %s; its modules are not spliced (the prompt "
                    "is computed in full)",
                    request.request_id,
                    share_blend,
                    self.blend_refusal,
                )
                return _Look([], (), num_blocks, frozenset(), recompute, share)
            count = inexact if layers >= self.num_layers else blend_count(share_blend, inexact)
        spans = None
        if ape != OFF:
            ranges = tuple((p.prompt_start, p.prompt_end) for p in run if not (p.prompt_start == 0 and p.offset == 0))
            spans = ApeSpans(ranges, *ape) if ranges else None
        look = _Look(
            matches,
            tuple(run),
            num_blocks,
            frozenset(),
            recompute,
            share,
            rankings,
            spans,
            first,
            exact,
            budgeted,
            choices,
            count,
            layers,
            inexact,
        )
        manager = self.kv_cache_manager
        if manager is None or not vllm_0_32.caches_prefixes(manager) or not run:
            return look  # nothing is cached (no block to tell apart), or nothing spliced (every token computed)
        spliced = [match for match in matches if match.start < run[-1].prompt_end]  # the run's modules, in order
        blocks = block_modules(spliced, self.block_size, 0, num_blocks)
        shared: tuple[str, ...] = (f"recompute_share={share!r}",) if share else ()
        keys = {
            block: tuple(match.name.identity for match in found)
            + tuple(f"recompute_first={look.first_count(m.start)}" for m in found if look.first_count(m.start))
            + shared
            + tuple(_ranking_digest(rankings[m.name]) for m in found if share and m.name in rankings)
            + tuple(f"recompute_budget={_digest(budgeted[m.start])}" for m in found if budgeted.get(m.start))
            for block, found in blocks.items()
        }
        if count:
            identity = _run_identity(run, look)
            look = replace(look, run_identity=f"{share_blend!r},{layers},{identity}")
            blended = f"recompute_blend={share_blend!r},layers={layers},run={identity}"
            for block in {
                p // self.block_size
                for piece in run
                if piece.module_start not in exact
                for p in range(piece.prompt_start, piece.prompt_end)
            }:
                if block < num_blocks:
                    keys[block] = (*keys.get(block, ()), blended)
        if spans is not None and spans.after // self.block_size < num_blocks:
            after = spans.after // self.block_size
            keys[after] = (*keys.get(after, ()), f"ape={spans.temperature!r},{spans.scale!r},{spans.ranges!r}")
        first_block = min(keys, default=num_blocks)
        if keys and not vllm_0_32.fold_into_block_hashes(self.vllm_config, manager, request, first_block, keys):
            logger.warning(
                "kvreuse: request %s: this engine's prefix-cache hashes cannot name module entries (hybrid "
                "KV cache); no module is spliced into it",
                request.request_id,
            )
            return _Look([], (), num_blocks, frozenset(), recompute, share)
        folded = frozenset(match.name for found in blocks.values() for match in found)
        return replace(look, first_block=first_block, folded=folded)

    def _count_skipped(
        self,
        request: Request,
        prompt: Sequence[int],
        matches: list[ModuleMatch],
        pieces: list[Piece],
        num_computed_tokens: int,
        stop: int,
    ) -> None:
        misses = self.trie.near_misses(prompt, matches, namespace=namespace_of(request.cache_salt))
        available = self.available.__contains__
        for skip in skipped_modules(matches, pieces, num_computed_tokens, stop, available, misses):
            # A module the index knows but whose name is not an entry's: no encoding for the request's adapter.
            other = skip.reason is SkipReason.NOT_STORED and skip.name in self.names
            reason = SkipReason.OTHER_ADAPTER if other else skip.reason
            self.skipped[reason] += 1
            logger.debug(
                "kvreuse module %r at token %d of request %s not spliced: %s",
                _shown(skip.name),
                skip.start,
                request.request_id,
                reason,
            )

    def _authorise(self, request: Request) -> ModuleWrite | None:
        """The encode request's write if it is well formed and proven (or writes are open), else ``None``."""
        params = request.kv_transfer_params
        try:
            namespace = namespace_of(request.cache_salt)
            write = encode_request(params, len(request.prompt_token_ids or ()), namespace)
        except ModuleRegistrationError as why:
            self.refused[WriteRefusal.MALFORMED] += 1
            logger.error("kvreuse: request %s runs without encoding a module: %s", request.request_id, why)
            return None
        assert write is not None and params is not None  # marks_encode held
        unkeyed = non_token_inputs(request)
        if unkeyed:
            self.refused[WriteRefusal.NON_TOKEN_INPUT] += 1
            logger.error(
                "kvreuse: request %s asked to write module %r with %s, whose KV its token ids do not name; refused "
                "(it runs as a plain request)",
                request.request_id,
                write.name,
                unkeyed,
            )
            return None
        write = replace(write, adapter=kv_adapter(request))
        if self.config.open_writes:
            return write
        prompt = request.prompt_token_ids or ()
        verdict = write_verdict(write, params, prompt, self.write_keys, self.seen_proofs)
        if verdict is not ProofVerdict.VALID:
            self.refused[WriteRefusal(verdict.value)] += 1
            logger.warning(
                "kvreuse: request %s asked to write module %r of namespace %s; refused (it runs as a plain request): "
                "%s (see the README's Security model)",
                request.request_id,
                write.name,
                namespace_label(namespace),
                verdict.why,
            )
            return None
        return write


def _shown(name: Hashable) -> Hashable:
    """A module's name for a log line: an entry's (``ModuleKey``) or an index entry's (``(namespace, name)``)."""
    if isinstance(name, ModuleKey):
        return name.name
    return name[1] if isinstance(name, tuple) and len(name) == 2 else name


def _run_identity(run: Sequence[Piece], look: _Look) -> str:
    """A short name of a spliced run (every module entry, where it stands, whether it is exact) and of every other
    choice of recompute in it (first tokens, the encode-time share and its rankings, the budget's tokens): what
    ``recompute_blend``'s choice over the run depends on besides the tokens before it. It does not depend on where
    vLLM's prefix hit ended."""
    pieces = [
        [
            getattr(p.name, "identity", repr(p.name)),
            p.prompt_start,
            p.length,
            p.module_start in look.exact,
            look.first_count(p.module_start),
            list(look.budgeted.get(p.module_start, ())),
            _ranking_digest(look.rankings[p.name]) if look.recompute_share and p.name in look.rankings else "",
        ]
        for p in run
    ]
    return _digest_text(json.dumps([pieces, look.recompute_share]))


def _ranking_digest(order: Sequence[int]) -> str:
    """A short name of a module's ranking (a module probed again ranks its tokens anew under the same entry)."""
    return "ranking=" + _digest(order)


def _digest(indices: Sequence[int]) -> str:
    """A short name of a list of a module's token indices."""
    return _digest_text(json.dumps(list(indices)))


def _digest_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def blend_refusal(vllm_config: VllmConfig) -> str:
    """Why this engine cannot run ``modules.recompute_blend``'s pass, or ``""``: the pass computes the model's first
    layers over every spliced token in the worker, so one worker must hold every head and layer."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        return (
            f"needs one worker holding the whole model (tensor parallel {parallel.tensor_parallel_size}, pipeline "
            f"parallel {parallel.pipeline_parallel_size})"
        )
    return ""


NO_APE = (
    f"runs another attention than kvreuse's backend over vLLM's CPU build ({SPARSE_CPU_SWITCH}=1), whose Triton "
    "kernels (CUDA) and vLLM's own backends know no APE bias"
)


def applies_ape(vllm_config: VllmConfig) -> bool:
    """Whether this engine's attention applies APE: kvreuse's backend in place of CPU_ATTN on vLLM's CPU build."""
    return vllm_0_32.device_type(vllm_config) == "cpu" and os.environ.get(SPARSE_CPU_SWITCH, "").lower() in TRUE_WORDS


def _progress(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """vLLM's count of computed tokens, before this step, of each request the step schedules."""
    progress = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    progress.update(zip(cached.req_ids, cached.num_computed_tokens))
    return progress


def _first(pieces: list[Piece], tokens: int, rid: str) -> list[Piece]:
    """The first ``tokens`` tokens of ``pieces`` (vLLM may take fewer tokens than offered)."""
    kept: list[Piece] = []
    left = tokens
    for piece in pieces:
        if left <= 0:
            break
        take = min(piece.length, left)
        kept.append(Piece(piece.name, piece.offset, piece.prompt_start, take))
        left -= take
    if left:
        raise RuntimeError(
            f"{ConnectorName.MODULE_CACHE}: vLLM took {tokens} tokens of request {rid}, more than the "
            f"{tokens - left} planned"
        )
    return kept
