"""Worker side of the module-cache connector (``kvreuse.vllm.modules.connector``): the store, and KV in and out of
vLLM's cache.

It runs in each vLLM worker process and owns that process's :class:`~kvreuse.modules.store.ModuleStore`. Per step
it writes the planned pieces into their slots (re-rotated, through the attention backend's ``do_kv_cache_update``),
copies the KV of finished encode requests out of the paged cache into the store, and reports back what entered and
left the store and which blocks could not be loaded.

The worker registers itself in the process's runtime handle (``kvreuse.vllm.runtime``), where
``module_figures()`` reads its counters (e.g. through ``LLM.collective_rpc``); the same counts go to vLLM's metrics
every step (``kvreuse.vllm.modules.metrics``), with the sparse backend's figures where it runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvreuse.errors import (
    ConfigError,
    ModuleRegistrationError,
    ModuleTooLarge,
    RerotationMismatch,
    UnsupportedPositionalEncoding,
)
from kvreuse.kernels.rerotate import RopeSpec, check_rerotation
from kvreuse.modules.blend import encode_deviation, token_scores
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.encodings import Encoding
from kvreuse.modules.namespace import namespace_label
from kvreuse.modules.splice import Piece, merge_positions, piece_kv, true_positions
from kvreuse.modules.store import EncodedModule, ModuleKey, ModuleStore, context_fingerprint
from kvreuse.patches import vllm_0_32
from kvreuse.sparse.figures import FigureIncrements
from kvreuse.vllm.metrics import KVReuseStats
from kvreuse.vllm.modules import blend
from kvreuse.vllm.modules.common import LoadSpec, ModuleCacheMetadata, ModuleCacheWorkerMeta, SaveSpec
from kvreuse.vllm.modules.metrics import module_counter_values
from kvreuse.vllm.names import SPARSE_CPU_SWITCH, ConnectorName
from kvreuse.vllm.runtime import runtime
from kvreuse.vllm.settings import kvreuse_flags
from kvreuse.vllm.sparse import backend as sparse_backend
from kvreuse.vllm.sparse.metrics import sparse_increments

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = logging.getLogger("vllm.plugins.kvreuse")

# Backends whose per-layer view is not the plain [blocks, kv_heads, block_size, 2 * head_dim] layout.
PACKED_LAYOUT_BACKENDS = {
    "CPU_ATTN": f"it packs KV in an ISA-specific layout the connector does not read; set {SPARSE_CPU_SWITCH}=1 to "
    "run kvreuse's attention backend in its place, which gives the connector plain views of the KV (dense with "
    '--additional-config \'{"kvreuse": {"sparse": {"beta": "inf"}}}\')'
}


def model_identity(vllm_config: VllmConfig) -> tuple[str, str]:
    """The (model id, tokenizer id) modules are fingerprinted with."""
    model = vllm_config.model_config
    return (f"{model.model}@{model.revision or ''}", f"{model.tokenizer}@{model.tokenizer_revision or ''}")


@dataclass
class ModuleFigures:
    """Counters of one worker since it started (the store's own are in ``ModuleStore.figures``).

    ``pieces_loaded``/``tokens_loaded``: module pieces and prompt tokens written into requests;
    ``load_failures``: pieces that could not be loaded (recomputed by vLLM); ``modules_encoded``: encode requests
    whose module entered the store; ``encode_failures``: those refused (too large, bad tokens); ``load_s``:
    host seconds spent looking modules up and writing them into requests (on a GPU, the copies and rotations it
    queues run on the device afterwards); ``blend_passes``/``blend_tokens``/``blend_s``: requests whose recompute
    ``modules.recompute_blend`` chose, the spliced tokens its pass ran through the first layers, and the seconds the
    passes took (``kvreuse.vllm.modules.blend``; on a GPU, host seconds until the choice, which waits for the pass).
    """

    pieces_loaded: int = 0
    tokens_loaded: int = 0
    load_failures: int = 0
    modules_encoded: int = 0
    encode_failures: int = 0
    load_s: float = 0.0
    blend_passes: int = 0
    blend_tokens: int = 0
    blend_s: float = 0.0


class ModuleWorker:
    """One worker process's module store and the copies of KV between it and vLLM's paged cache."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.config = ModulesConfig.load(kvreuse_flags(vllm_config.additional_config, "modules"))
        model_id, tokenizer_id = model_identity(vllm_config)
        self.store = ModuleStore(self.config, model_id=model_id, tokenizer_id=tokenizer_id)
        self.spec: RopeSpec | None = None  # None: positions cannot be moved, every load fails over to recompute
        # Whether every layer's attention masks by position (kvreuse's backend), which recomputing tokens inside a
        # spliced run needs; where not, such a load fails over to vLLM's recompute of the whole run.
        self.masks_by_position = False
        self.layers: list[str] = []
        self._sparse_layers: set[str] = set()  # the layers kvreuse's attention backend serves
        self._copies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._errors: set[int] = set()
        self._report = ModuleCacheWorkerMeta()
        self._known: set[ModuleKey] = set()
        self._reported: dict[str, int] = {}
        self._sparse_increments = FigureIncrements()  # the sparse backend's figures, sent with the module counters
        self.figures = ModuleFigures()
        # (request id, piece, slots) of every piece written by the last step that loaded any: lets a test or an
        # operator read back exactly what was spliced where.
        self.last_loads: list[tuple[str, Piece, tuple[int, ...]]] = []
        self._loaded_early: set[str] = set()  # this step's requests loaded before the forward's inputs were moved
        self._decoder: vllm_0_32.DecoderLayers | None = None  # the model's layers, for recompute_blend's pass
        self._decoder_refusal = ""  # why the model's layers cannot run the pass (logged once)
        runtime().module_worker = self

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Learn the attention layers (in model order), refuse packed layouts, check RoPE on the cache's device."""
        self.layers = sorted(kv_caches, key=vllm_0_32.layer_index)
        backends = vllm_0_32.attention_backend_names(self.vllm_config, self.layers)
        for name in self.layers:
            backend = backends[name]
            if backend in PACKED_LAYOUT_BACKENDS:
                raise ConfigError(
                    f"{ConnectorName.MODULE_CACHE} cannot use attention backend {backend} (layer {name}): "
                    f"{PACKED_LAYOUT_BACKENDS[backend]}"
                )
            if kv_caches[name].dim() != 4:
                raise ConfigError(
                    f"{ConnectorName.MODULE_CACHE} needs per-layer KV caches [blocks, kv_heads, block_size, "
                    f"2 * head_dim]; layer {name} ({backend}) has {tuple(kv_caches[name].shape)}"
                )
        # kvreuse's backend names itself CUSTOM (SparseAttentionBackend.get_name), also where it replaces CPU_ATTN.
        # It keeps K/V apart from vLLM's page strides, in CPU_ATTN's tiles on a CPU (kvreuse.vllm.sparse.backend
        # .layer_cache): its layers' K/V are read through its views (kv_of).
        self._sparse_layers = {name for name in self.layers if backends[name] == "CUSTOM"}
        self.masks_by_position = len(self._sparse_layers) == len(self.layers)
        if not self.masks_by_position and (
            self.config.recompute_first
            or self.config.recompute_share
            or self.config.recompute_budget
            or self.config.recompute_blend
        ):
            # recompute_first is on by default (16): say once at start what a GPU user's stock backend costs.
            logger.warning(
                "kvreuse: modules.recompute_first=%d / recompute_share=%s / recompute_budget=%s need kvreuse's "
                "attention backend in every layer (--attention-backend CUSTOM), not %s: every request that splices "
                "modules will compute its whole run instead; set modules.recompute_first 0 (and recompute_share and "
                "recompute_budget 0) for the plain splice",
                self.config.recompute_first,
                self.config.recompute_share,
                self.config.recompute_budget,
                ", ".join(sorted({backends[name] for name in self.layers if backends[name] != "CUSTOM"})),
            )
        vllm_0_32.remap_scheduled_tokens(self.plan_step, _publish_positions, true_positions)
        first = kv_caches[self.layers[0]]
        try:
            self.spec = check_rerotation(
                self.vllm_config.model_config.hf_config.to_dict(),
                device=first.device,
                dtype=first.dtype,
                num_kv_heads=first.shape[1],
            )
        except (UnsupportedPositionalEncoding, RerotationMismatch) as why:
            logger.error("kvreuse module cache is off for this model: %s", why)

    # -- loads --------------------------------------------------------------------------------------------------
    def load(self, meta: ModuleCacheMetadata, forward_context: ForwardContext) -> None:
        if meta.prefetch and self.config.prefetch_depth:
            self.store.prefetch(meta.prefetch)
        early, self._loaded_early = self._loaded_early, set()
        loads = [spec for spec in meta.loads if spec.req_id not in early]
        if not loads:
            return
        if not early:
            self.last_loads = []
        started = time.perf_counter()
        for spec in loads:
            self._load_request(spec)
        self.figures.load_s += time.perf_counter() - started

    def plan_step(self, meta: object, req_ids: Sequence[str], model: object) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Called with a step's inputs (``vllm_0_32.remap_scheduled_tokens``), its requests in batch order and the
        runner's model: hands the attention backend the APE spans of those with APE (``runtime().step_ape``), runs
        ``recompute_blend``'s pass for the loads that ask for it (loading them first), and returns per request that
        recomputes tokens inside its spliced run where vLLM's scheduled tokens start and the positions they stand
        for (what the wrapper moves)."""
        runtime().step_ape = None
        self._loaded_early = set()
        if not isinstance(meta, ModuleCacheMetadata) or not self.masks_by_position:
            if isinstance(meta, ModuleCacheMetadata) and meta.ape:
                logger.error(
                    "kvreuse: requests %s ask for APE, which needs kvreuse's attention backend in every layer; "
                    "they attend without it",
                    sorted(meta.ape),
                )
            return {}
        if meta.ape:
            runtime().step_ape = tuple(meta.ape.get(rid) for rid in req_ids)
        moves = {}
        for spec in meta.loads:
            if spec.blend is not None:
                moves[spec.req_id] = (spec.start, merge_positions(spec.recompute, self._blend(spec, model)))
            elif spec.recompute:
                moves[spec.req_id] = (spec.start, spec.recompute)
        return moves

    def _blend(self, spec: LoadSpec, model: object) -> tuple[int, ...]:
        """Load ``spec`` now and run ``recompute_blend``'s pass over it (``kvreuse.vllm.modules.blend``): the
        positions it adds to the load's recompute. Where the load or the pass cannot run, every block of the load is
        reported to vLLM as failed (it computes them: never a splice without the asked recompute) and the positions
        are the first open candidates (the step's output for the request is discarded)."""
        assert spec.blend is not None
        started = time.perf_counter()
        if not self._loaded_early:
            self.last_loads = []
        self._loaded_early.add(spec.req_id)
        failures = self.figures.load_failures
        self._load_request(spec)
        self.figures.load_s += time.perf_counter() - started
        decoder = self._decoder_of(model) if self.figures.load_failures == failures else None
        if decoder is None:
            if self.figures.load_failures == failures:  # the load went in, the pass cannot run: fail it over
                self._errors.update(block for blocks in spec.blocks for block in blocks)
                self.figures.load_failures += len(spec.pieces)
            taken = set(spec.recompute)
            return tuple(p for p in spec.blend.candidates if p not in taken)[: spec.blend.count]
        started = time.perf_counter()
        layers = vllm_0_32.static_attention_layers(self.vllm_config, self.layers)
        caches = [self.kv_of(name, vllm_0_32.layer_kv_cache(layer)) for name, layer in zip(self.layers, layers)]

        def write(layer: int, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
            vllm_0_32.write_kv(layers[layer], keys, values, slots)

        chosen = blend.choose(spec, self._token_ids(spec), decoder, caches, write)
        if spec.blend.count:  # a choice over the whole run: the scheduler side keeps it for identical requests
            self._report.blended[spec.req_id] = chosen
        self.figures.blend_passes += 1
        self.figures.blend_tokens += len(spec.blend.candidates)
        self.figures.blend_s += time.perf_counter() - started
        return chosen

    def _decoder_of(self, model: object) -> vllm_0_32.DecoderLayers | None:
        """The model's layers for the pass, or ``None`` where they cannot run it (logged once)."""
        if self._decoder is None and not self._decoder_refusal:
            try:
                self._decoder = vllm_0_32.decoder_layers(model)
            except ConfigError as why:
                self._decoder_refusal = str(why)
                logger.error("kvreuse: %s; requests with recompute_blend compute their spliced runs instead", why)
        return self._decoder

    def _token_ids(self, spec: LoadSpec) -> list[int]:
        """The token ids at the blend's candidate positions, from the loaded modules."""
        assert spec.blend is not None
        by_position: dict[int, int] = {}
        for piece in spec.pieces:
            module = self.store.get(piece.name)
            assert module is not None  # loaded this step
            ids = module.token_ids[piece.offset : piece.offset + piece.length]
            by_position.update(zip(range(piece.prompt_start, piece.prompt_end), ids))
        return [by_position[position] for position in spec.blend.candidates]

    def _load_request(self, spec: LoadSpec) -> None:
        if (spec.recompute or spec.blend is not None) and not self.masks_by_position:
            self._errors.update(block for blocks in spec.blocks for block in blocks)
            self.figures.load_failures += len(spec.pieces)
            logger.warning(
                "kvreuse: request %s recomputes tokens inside its spliced modules, which needs kvreuse's attention "
                "backend in every layer; vLLM computes the whole run instead",
                spec.req_id,
            )
            return
        for piece, slots, blocks in zip(spec.pieces, spec.slots, spec.blocks):
            module = self.store.get(piece.name) if self.spec is not None else None
            if module is None or module.num_layers != len(self.layers):
                self._errors.update(blocks)
                self.figures.load_failures += 1
                logger.warning(
                    "kvreuse module %r could not be loaded for request %s; vLLM recomputes its %d tokens",
                    getattr(piece.name, "name", piece.name),
                    spec.req_id,
                    piece.length,
                )
                continue
            self._write(module, piece, slots)
            self.last_loads.append((spec.req_id, piece, slots))
            self.figures.pieces_loaded += 1
            self.figures.tokens_loaded += piece.length

    def _write(self, module: EncodedModule, piece: Piece, slots: tuple[int, ...]) -> None:
        assert self.spec is not None
        layers = vllm_0_32.static_attention_layers(self.vllm_config, self.layers)
        device = vllm_0_32.layer_kv_cache(layers[0]).device
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        for layer, (keys, values) in zip(layers, piece_kv(module, piece, self.spec, device)):
            vllm_0_32.write_kv(layer, keys, values, slot_mapping)

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def kv_of(self, layer_name: str, kv_cache: torch.Tensor) -> blend.PlainKV:
        """Layer ``layer_name``'s keys and values as ``[blocks, block_size, kv_heads, head_dim]`` views, from vLLM's
        per-layer view ``kv_cache``: through kvreuse's backend where it serves the layer (it keeps K/V packed apart
        from its key sketches, not at vLLM's page strides, and on a CPU in CPU_ATTN's tiles), else vLLM's plain
        K|V rows."""
        if layer_name in self._sparse_layers:
            return sparse_backend.plain_kv(kv_cache)
        return blend.split_kv(kv_cache)

    # -- saves --------------------------------------------------------------------------------------------------
    def copy_layer(self, meta: ModuleCacheMetadata, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's KV of every module being encoded this step (called after the layer's attention)."""
        if not meta.saves:
            return
        cache = self.kv_of(layer_name, kv_layer)
        for save in meta.saves:
            slots = torch.tensor(save.slots, dtype=torch.int64, device=kv_layer.device)
            keys, values = blend.read_kv(cache, slots)  # [tokens, kv_heads, head_dim] each
            self._copies.setdefault(save.req_id, []).append((keys.clone(), values.clone()))

    def store_saved(self, meta: ModuleCacheMetadata) -> None:
        """Put the modules copied this step into the store (called once per step, after the forward)."""
        for save in meta.saves:
            copies = self._copies.pop(save.req_id, [])
            if len(copies) != len(self.layers):
                continue  # no forward ran for it this step (vLLM sends metadata to empty steps too)
            kv = torch.stack([torch.stack(pair) for pair in copies])  # [layers, 2, tokens, kv_heads, head_dim]
            if save.probe:
                self._rank(save, kv)
                continue
            try:
                module = EncodedModule(
                    save.name,
                    self.store.model_id,
                    self.store.tokenizer_id,
                    save.token_ids,
                    save.start,
                    kv,
                    context=context_fingerprint(save.context),
                    adapter=save.adapter,
                    namespace=save.namespace,
                )
                tier = self.store.put(module, replace=save.replace)
            except (ModuleRegistrationError, ModuleTooLarge) as why:  # ModuleConflict: other content, no replace
                self._report.failed[f"{save.name!r} of namespace {namespace_label(save.namespace)}"] = str(why)
                self.figures.encode_failures += 1
                continue
            self._report.stored[module.key] = module.token_ids
            primary = self.store.current(save.name, save.namespace, save.adapter) == module.key
            self._report.placed[module.key] = Encoding(
                module.key, save.adapter, save.context, module.start, primary, module.version
            )
            self._known.add(module.key)
            self.figures.modules_encoded += 1
            logger.info(
                "kvreuse module %r of namespace %s: %d tokens at position %d, %d bytes, stored in %s (version %d)",
                save.name,
                namespace_label(save.namespace),
                len(save.token_ids),
                save.start,
                module.nbytes,
                tier,
                module.version,
            )

    def _rank(self, save: SaveSpec, kv: torch.Tensor) -> None:
        """Score the stored entry of ``save.name`` by how far its KV lies from ``kv``, its tokens encoded after a
        probe context (``kvreuse.modules.blend``); the scheduler side turns the scores into the tokens a splice
        recomputes (``modules.recompute_share``)."""
        where = f"{save.name!r} of namespace {namespace_label(save.namespace)}"
        key = self.store.current(save.name, save.namespace, save.adapter)
        stored = self.store.get(key, use=False) if key is not None else None  # not a module hit: no splice
        if stored is None or self.spec is None:
            self._report.failed[where] = (
                "a probe needs the module stored first (encode it, then probe it); no token choice"
                if self.spec is not None
                else "positions cannot be moved for this model; no token choice"
            )
            return
        probe = EncodedModule(
            save.name,
            stored.model_id,
            stored.tokenizer_id,
            save.token_ids,
            save.start,
            kv,
            adapter=save.adapter,
            namespace=save.namespace,
        )
        try:
            deviation = encode_deviation(stored, probe, self.spec)
        except ValueError as why:  # the probe's tokens are not the module's
            self._report.failed[where] = str(why)
            return
        assert key is not None
        self._report.scores[key] = token_scores(deviation)
        logger.info("kvreuse module %s: tokens ranked against a probe context of %d tokens", where, save.start)

    # -- reports --------------------------------------------------------------------------------------------------
    def take_report(self) -> ModuleCacheWorkerMeta | None:
        """What entered the store since the last report, and what left it (evicted, failed to load)."""
        lost = {key for key in self._known if key not in self.store}
        self._known -= lost
        self._report.dropped |= lost
        self._report.stored = {k: v for k, v in self._report.stored.items() if k not in lost}
        self._report.placed = {k: v for k, v in self._report.placed.items() if k not in lost}
        report = self._report
        self._report = ModuleCacheWorkerMeta()
        report.scores = {k: v for k, v in report.scores.items() if k not in lost}
        return report if (report.stored or report.dropped or report.failed or report.scores or report.blended) else None

    def take_increments(self) -> KVReuseStats | None:
        """The counters' increments since the last call, for vLLM's metrics (``None`` when nothing changed)."""
        now = module_counter_values(self.figures, self.store.figures)
        delta: dict[str, float] = {name: value - self._reported.get(name, 0) for name, value in now.items()}
        delta = {name: value for name, value in delta.items() if value}
        self._reported = now
        delta.update(sparse_increments(runtime().sparse_attention, self._sparse_increments))
        return KVReuseStats(data=delta) if delta else None

    def close(self) -> None:
        self.store.close()
        handle = runtime()
        if handle.module_worker is self:
            handle.module_worker = None


def _publish_positions(positions: torch.Tensor | None) -> None:
    """Hand this step's token positions to the attention backend (``None``: all in order)."""
    runtime().step_positions = positions
