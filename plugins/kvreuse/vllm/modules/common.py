"""What crosses between the sides of the module-cache connector: the encode request's parameters (client ->
scheduler), the per-step metadata (scheduler -> worker) and the worker's report (worker -> scheduler).

Both sides import this module, never each other (nor the connector facade), as in vLLM's own ``OffloadingConnector``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvreuse.errors import ModuleRegistrationError, RequestParameterError
from kvreuse.modules.config import MAX_BLEND_LAYERS
from kvreuse.modules.encodings import NO_ADAPTER, Encoding
from kvreuse.modules.namespace import GLOBAL
from kvreuse.modules.splice import Piece
from kvreuse.modules.store import ModuleKey
from kvreuse.modules.writes import (
    WRITE_PROOF,
    ProofVerdict,
    SeenNonces,
    WriteClaim,
    check_module_name,
    check_proof,
    content_digest,
)
from kvreuse.sparse.ape import OFF, ApeSpans, check_ape

# The keys of an encode request's kv_transfer_params (and WRITE_PROOF, which the guard or the offline API adds).
ENCODE_MODULE = "kvreuse_module"
ENCODE_CONTEXT = "kvreuse_context"
ENCODE_REPLACE = "kvreuse_replace"  # an explicit replacement of the module stored under the name
ENCODE_PROBE = "kvreuse_probe"  # the module's tokens after a probe context: rank the stored entry's, store nothing
RECOMPUTE_FIRST = "kvreuse_recompute_first"  # a request's own modules.recompute_first
RECOMPUTE_SHARE = "kvreuse_recompute_share"  # a request's own modules.recompute_share
RECOMPUTE_BUDGET = "kvreuse_recompute_budget"  # a request's own modules.recompute_budget
RECOMPUTE_BLEND = "kvreuse_recompute_blend"  # a request's own modules.recompute_blend
BLEND_LAYERS = "kvreuse_blend_layers"  # a request's own modules.blend_layers
APE = "kvreuse_ape"  # a request's own modules.ape_temperature / ape_scale: {"temperature": T, "scale": S}
SHADOW = "kvreuse_shadow"  # one half of a shadow check: {"pair": NAME, "full": true|false} (kvreuse.modules.shadow)
# In a finished request's output (not a request key): {"tokens": T, "layers": L} of the pass recompute_blend ran.
BLEND_PASS = "kvreuse_blend_pass"


def encode_params(name: str, context_tokens: int = 0, *, replace: bool = False, probe: bool = False) -> dict[str, Any]:
    """The ``kv_transfer_params`` of an encode request for module ``name`` after ``context_tokens`` tokens (with
    ``replace``: replacing the module stored under ``name`` in the request's namespace; with ``probe``: the tokens
    after the context are the stored module's, encoded after a probe context, and rank its tokens for
    ``modules.recompute_share`` instead of being stored, ``kvreuse.modules.blend``)."""
    params: dict[str, Any] = {ENCODE_MODULE: name, ENCODE_CONTEXT: int(context_tokens)}
    if replace:
        params[ENCODE_REPLACE] = True
    if probe:
        params[ENCODE_PROBE] = True
    return params


def marks_encode(params: object) -> bool:
    """Whether a request's ``kv_transfer_params`` ask to encode a module (well formed or not; anything but a
    mapping asks nothing)."""
    return isinstance(params, Mapping) and ENCODE_MODULE in params


# Token counts and positions feed vLLM's int32 position and slot tensors.
MAX_TOKENS = 2**31 - 1
KNOWN = (
    ENCODE_MODULE,
    ENCODE_CONTEXT,
    ENCODE_REPLACE,
    ENCODE_PROBE,
    RECOMPUTE_FIRST,
    RECOMPUTE_SHARE,
    RECOMPUTE_BUDGET,
    RECOMPUTE_BLEND,
    BLEND_LAYERS,
    APE,
    SHADOW,
    WRITE_PROOF,
)
FIELD = "kv_transfer_params"


def recompute_first(params: object, default: int) -> int:
    """The tokens per spliced module a request recomputes: its ``kv_transfer_params``' :data:`RECOMPUTE_FIRST`,
    else ``default`` (``modules.recompute_first``).

    Raises :class:`RequestParameterError` for a value that is not an integer from 0 to :data:`MAX_TOKENS`.
    """
    if not isinstance(params, Mapping) or RECOMPUTE_FIRST not in params:
        return default
    value = params[RECOMPUTE_FIRST]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise RequestParameterError(
            f"{FIELD}.{RECOMPUTE_FIRST}",
            f"{RECOMPUTE_FIRST} must be a non-negative integer up to {MAX_TOKENS} (tokens per module), "
            f"got {_shown(value)}",
        )
    return value


def recompute_share(params: object, default: float) -> float:
    """The share of each spliced module's tokens, by the ranking chosen when it was encoded, that a request
    recomputes: its ``kv_transfer_params``' :data:`RECOMPUTE_SHARE`, else ``default`` (``modules.recompute_share``).

    Raises :class:`RequestParameterError` for a value that is not a number from 0 to 1.
    """
    return _share(params, RECOMPUTE_SHARE, default, "each module's tokens")


def ape_setting(params: object, default: tuple[float, float]) -> tuple[float, float]:
    """The (temperature, scale) of APE a request's later tokens attend to its spliced modules with: its
    ``kv_transfer_params``' :data:`APE` (either key may be left out: 1), else ``default`` (``modules.ape_temperature``,
    ``modules.ape_scale``); ``(1.0, 1.0)`` is off.

    Raises :class:`RequestParameterError` for a value that is not an object of numbers within APE's bounds
    (``kvreuse.sparse.ape.check_ape``: they come from the arithmetic the values feed).
    """
    if not isinstance(params, Mapping) or APE not in params:
        return default
    value = params[APE]
    if not isinstance(value, Mapping) or not set(value) <= {"temperature", "scale"}:
        raise RequestParameterError(
            f"{FIELD}.{APE}",
            f'{APE} must be an object {{"temperature": T, "scale": S}} (either left out: 1 = off), got {_shown(value)}',
        )
    try:
        return check_ape(value.get("temperature", 1.0), value.get("scale", 1.0), APE)
    except ValueError as why:
        field = "temperature" if ": temperature " in str(why) else "scale"
        raise RequestParameterError(f"{FIELD}.{APE}.{field}", str(why)) from None


def shadow_half(params: object) -> tuple[str, bool] | None:
    """The shadow pair a request is one half of, and whether it is the full-prefill half: its
    ``kv_transfer_params``' :data:`SHADOW`, else ``None``.

    Raises :class:`RequestParameterError` for a value that is not ``{"pair": NAME, "full": true|false}`` with a name
    of 1-128 characters.
    """
    if not isinstance(params, Mapping) or SHADOW not in params:
        return None
    value = params[SHADOW]
    if (
        not isinstance(value, Mapping)
        or set(value) != {"pair", "full"}
        or not isinstance(value["pair"], str)
        or not 1 <= len(value["pair"]) <= 128
        or not isinstance(value["full"], bool)
    ):
        raise RequestParameterError(
            f"{FIELD}.{SHADOW}",
            f'{SHADOW} must be an object {{"pair": NAME (1-128 characters), "full": true or false}}, '
            f"got {_shown(value)}",
        )
    return value["pair"], value["full"]


def recompute_budget(params: object, default: float) -> float:
    """The share of a spliced run's module tokens a request recomputes under one budget
    (``kvreuse.modules.splice.budgeted_tokens``): its ``kv_transfer_params``' :data:`RECOMPUTE_BUDGET`, else
    ``default`` (``modules.recompute_budget``).

    Raises :class:`RequestParameterError` for a value that is not a number from 0 to 1.
    """
    return _share(params, RECOMPUTE_BUDGET, default, "the spliced run's module tokens")


def recompute_blend(params: object, default: float) -> float:
    """The share of a spliced run's inexact module tokens a request recomputes as chosen from its own context
    (``kvreuse.modules.blend``): its ``kv_transfer_params``' :data:`RECOMPUTE_BLEND`, else ``default``
    (``modules.recompute_blend``).

    Raises :class:`RequestParameterError` for a value that is not a number from 0 to 1.
    """
    return _share(params, RECOMPUTE_BLEND, default, "the spliced run's module tokens")


def blend_layers(params: object, default: int) -> int:
    """The layers a request computes for every spliced token before its :data:`RECOMPUTE_BLEND` choice: its
    ``kv_transfer_params``' :data:`BLEND_LAYERS`, else ``default`` (``modules.blend_layers``).

    Raises :class:`RequestParameterError` for a value that is not an integer from 1 to :data:`MAX_BLEND_LAYERS`.
    """
    if not isinstance(params, Mapping) or BLEND_LAYERS not in params:
        return default
    value = params[BLEND_LAYERS]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLEND_LAYERS:
        raise RequestParameterError(
            f"{FIELD}.{BLEND_LAYERS}",
            f"{BLEND_LAYERS} must be an integer from 1 to {MAX_BLEND_LAYERS} (layers computed for every spliced "
            f"token), got {_shown(value)}",
        )
    return value


def check_transfer_params(params: object) -> None:
    """Every kvreuse key of a request's ``kv_transfer_params`` well formed and within its bounds, so that nothing a
    request carries reaches the engine's arithmetic unchecked (issue 26): vLLM's front end refuses the request with
    a 400 naming the field (``patches.vllm_0_32.validate_extra_args``), and the scheduler side reads the
    values with the same functions. Bounds that depend on the prompt (an encode's context) are the scheduler's.

    Raises :class:`RequestParameterError`; a key starting with ``kvreuse_`` that kvreuse does not know is one too
    (a misspelt setting must not be ignored), and so is an encode's key (context, replace, probe) without the
    module it encodes, whatever its value.
    """
    if not isinstance(params, Mapping):
        return
    for key in params:
        if isinstance(key, str) and key.startswith("kvreuse_") and key not in KNOWN:
            raise RequestParameterError(
                f"{FIELD}.{key[:64]}", f"unknown kvreuse parameter {key[:64]!r}; known: {', '.join(KNOWN)}"
            )
    recompute_first(params, 0)
    recompute_share(params, 0.0)
    recompute_budget(params, 0.0)
    recompute_blend(params, 0.0)
    blend_layers(params, 1)
    ape_setting(params, OFF)
    shadow_half(params)
    if marks_encode(params):
        write_fields(params)
        return
    for key in (ENCODE_CONTEXT, ENCODE_REPLACE, ENCODE_PROBE):
        if key in params:
            raise RequestParameterError(
                f"{FIELD}.{key}",
                f"{key} is part of a module encode, which names its module in {ENCODE_MODULE}; add {ENCODE_MODULE} "
                f"or leave {key} out (got {key} = {_shown(params[key])} without it)",
            )


def write_fields(params: Mapping[str, Any]) -> tuple[str, int, bool, bool]:
    """An encode request's ``(name, context, replace, probe)``, each of its type, not both ``replace`` and ``probe``
    (a probe measures the stored entry and writes nothing), and within the bounds that do not depend on the prompt
    (a context of at most :data:`MAX_TOKENS`; :func:`encode_request` adds the prompt's).

    Raises :class:`RequestParameterError` naming the field.
    """
    try:
        name = check_module_name(params[ENCODE_MODULE])
    except ModuleRegistrationError as why:
        raise RequestParameterError(f"{FIELD}.{ENCODE_MODULE}", f"{ENCODE_MODULE}: {why}") from None
    context = params.get(ENCODE_CONTEXT, 0)
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= MAX_TOKENS:
        raise RequestParameterError(
            f"{FIELD}.{ENCODE_CONTEXT}",
            f"{ENCODE_CONTEXT} must be an integer from 0 to {MAX_TOKENS} (tokens before the module), got "
            f"{_shown(context)}",
        )
    replace, probe = params.get(ENCODE_REPLACE, False), params.get(ENCODE_PROBE, False)
    for flag, value in ((ENCODE_REPLACE, replace), (ENCODE_PROBE, probe)):
        if not isinstance(value, bool):
            raise RequestParameterError(f"{FIELD}.{flag}", f"{flag} must be true or false, got {_shown(value)}")
    if probe and replace:
        raise RequestParameterError(
            f"{FIELD}.{ENCODE_PROBE}",
            f"{ENCODE_PROBE} of module {name!r}: a probe replaces nothing ({ENCODE_REPLACE} must be false)",
        )
    return name, context, replace, probe


def transfer_params_refusal(params: object) -> tuple[str, str] | None:
    """:func:`check_transfer_params` as ``(field, message)``, or ``None`` if the parameters pass."""
    try:
        check_transfer_params(params)
    except RequestParameterError as why:
        return why.field, str(why)
    return None


def _share(params: object, key: str, default: float, of: str) -> float:
    """``params``' share ``key`` (a number from 0 to 1, a share of ``of``), else ``default``; a
    :class:`RequestParameterError` naming the field otherwise."""
    if not isinstance(params, Mapping) or key not in params:
        return default
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise RequestParameterError(
            f"{FIELD}.{key}", f"{key} must be a number from 0 to 1 (share of {of}), got {_shown(value)}"
        )
    return float(value)


def _shown(value: object) -> str:
    """A value for an error message, cut short (a request may send a huge string or number)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        text = f"an integer of over {sys.get_int_max_str_digits()} digits"
    return text if len(text) <= 40 else text[:37] + "..."


def kv_adapter(request: Any) -> str:
    """What a vLLM request's KV is computed with besides the model's weights, as a module entry records it
    (``kvreuse.modules.encodings``): ``""`` for the base model, else its LoRA adapter, named as vLLM names it in its
    own prefix-cache hashes (name and path) and hashed to a label of bounded length."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return NO_ADAPTER
    named = json.dumps([str(lora.lora_name), str(lora.lora_path)])
    return "lora:" + hashlib.sha256(named.encode()).hexdigest()[:32]


def non_token_inputs(request: Any) -> str | None:
    """What a vLLM request feeds the model besides its token ids, whose KV the ids therefore do not name
    (``"multimodal inputs"``, ``"prompt embeddings"``), or ``None``. The module cache neither splices into nor
    encodes from such a request."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None


@dataclass(frozen=True)
class ModuleWrite:
    """An encode request's write: store the prompt's tokens after ``context`` as module ``name`` of ``namespace``
    (replacing the entry stored under the name there if ``replace``); a ``probe`` ranks the stored entry's tokens
    by how far its KV lies from the prompt's instead (``kvreuse.modules.blend``). ``adapter``: the request's
    (:func:`kv_adapter`), which the entry records."""

    name: str
    context: int
    namespace: str
    replace: bool
    probe: bool = False
    adapter: str = NO_ADAPTER

    def claim(self, prompt_token_ids: Sequence[int]) -> WriteClaim:
        """What a proof of this write must vouch for, the request's prompt being ``prompt_token_ids``."""
        return WriteClaim(
            self.name, self.context, self.namespace, self.replace, self.probe, content_digest(prompt_token_ids)
        )


def encode_request(params: object, num_prompt_tokens: int, namespace: str = GLOBAL) -> ModuleWrite | None:
    """The write ``kv_transfer_params`` ask for, else ``None``; ``namespace`` is the request's
    (``kvreuse.modules.namespace.namespace_of`` its cache salt).

    Raises :class:`ModuleRegistrationError` for malformed parameters (the request then runs as a plain one).
    Whether the write is allowed is :func:`write_allowed`'s question.
    """
    if not marks_encode(params):
        return None
    assert isinstance(params, Mapping)
    try:
        name, context, replace, probe = write_fields(params)
    except RequestParameterError as why:
        raise ModuleRegistrationError(str(why)) from None
    if context >= num_prompt_tokens:
        raise ModuleRegistrationError(
            f"{ENCODE_CONTEXT} of module {name!r} must be an integer in "
            f"0..{num_prompt_tokens - 1} (the prompt has {num_prompt_tokens} tokens), "
            f"got {context}"
        )
    return ModuleWrite(name, context, namespace, replace, probe)


def write_verdict(
    write: ModuleWrite,
    params: Mapping[str, Any],
    prompt_token_ids: Sequence[int],
    keys: Sequence[str],
    seen: SeenNonces,
) -> ProofVerdict:
    """Whether the request proves its write (``WRITE_PROOF`` in its ``kv_transfer_params``: the HTTP guard's under
    the module-write key, the offline API's under the local secret) for its very prompt, unexpired and for the first
    time (``kvreuse.modules.writes.check_proof``; an accepted proof's nonce is remembered in ``seen``)."""
    return check_proof(keys, params.get(WRITE_PROOF), write.claim(prompt_token_ids), seen)


@dataclass(frozen=True)
class LoadSpec:
    """Write these pieces (``Piece.name`` is a :class:`ModuleKey`) into request ``req_id``'s slots."""

    req_id: str
    pieces: tuple[Piece, ...]
    slots: tuple[tuple[int, ...], ...]  # per piece, the slot of each of its tokens
    blocks: tuple[tuple[int, ...], ...]  # per piece, the blocks its tokens lie in (reported if it fails)
    # Prompt positions inside the pieces that this step computes instead (ascending; empty: none). vLLM then counts
    # only ``start`` tokens as computed and schedules these first, at positions ``start ..``; the worker moves them
    # to their own positions before the forward (``kvreuse.patches.vllm_0_32.remap_scheduled_tokens``).
    recompute: tuple[int, ...] = ()
    start: int = 0
    blend: BlendSpec | None = None  # more positions to recompute, chosen by the worker from the request's context


@dataclass(frozen=True)
class BlendSpec:
    """``modules.recompute_blend`` for one load: the worker computes the first ``layers`` layers for every
    ``candidates`` position (the run's tokens whose spliced KV is not a full prefill's, ascending, all inside the
    load's pieces), writes their exact KV of layers ``0 .. layers``, and adds to the load's ``recompute`` the
    ``count`` candidates outside it whose KV deviates most on layer ``layers`` (``kvreuse.modules.blend``); the
    load's ``start`` counts them already. ``context_slots``: the slots of the prompt's tokens before the pieces
    (vLLM's prefix hit), which the pass attends to. A ``count`` of 0 runs the pass without a choice: the rest of a
    run whose choice an identical request made (its blocks are vLLM's prefix hit; the tokens it chose in the rest
    are in the load's ``recompute``)."""

    count: int
    layers: int
    candidates: tuple[int, ...]
    context_slots: tuple[int, ...]


@dataclass(frozen=True)
class SaveSpec:
    """After this step, copy tokens at ``slots`` of request ``req_id`` into the store as module ``name`` of
    ``namespace`` (replacing the entry stored under the name if ``replace``), computed after ``context`` with
    ``adapter``."""

    req_id: str
    name: str
    token_ids: tuple[int, ...]
    start: int  # position of the module's first token (the context's length)
    slots: tuple[int, ...]
    context: tuple[int, ...]  # the token ids before the module
    namespace: str
    replace: bool
    probe: bool = False  # rank the stored entry's tokens against these (kvreuse.modules.blend), store nothing
    adapter: str = NO_ADAPTER


@dataclass
class ModuleCacheMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    prefetch: list[ModuleKey] = field(default_factory=list)  # modules waiting requests will load, in order
    # Scheduled requests whose later tokens attend to their spliced modules with APE (every step until they finish).
    ape: dict[str, ApeSpans] = field(default_factory=dict)


@dataclass
class ModuleCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: what entered and left the store.

    With tensor parallelism each worker stores its own heads' share; a module is usable once every worker stored
    it, and unusable as soon as one lost it, so aggregation intersects ``stored`` and unites ``dropped``.

    Per-token deviation ``scores`` of a probed module (``kvreuse.modules.blend.token_scores``) are sums over
    heads, so aggregation adds each worker's share.
    """

    stored: dict[ModuleKey, tuple[int, ...]] = field(default_factory=dict)
    dropped: set[ModuleKey] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # module (name, namespace label) -> why it was not stored
    scores: dict[ModuleKey, tuple[float, ...]] = field(default_factory=dict)  # probed modules: per token
    # stored modules: what each was computed with and after, and whether it is its name's primary encoding
    placed: dict[ModuleKey, Encoding] = field(default_factory=dict)
    # requests whose recompute_blend pass ran: the positions it chose (one worker runs it: blend_refusal)
    blended: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def aggregate(self, other: ModuleCacheWorkerMeta) -> ModuleCacheWorkerMeta:
        return ModuleCacheWorkerMeta(
            stored={key: ids for key, ids in self.stored.items() if key in other.stored},
            dropped=self.dropped | other.dropped,
            failed={**self.failed, **other.failed},
            scores={
                key: tuple(a + b for a, b in zip(mine, other.scores[key]))
                for key, mine in self.scores.items()
                if key in other.scores
            },
            placed={key: where for key, where in self.placed.items() if key in other.placed},
            blended={**self.blended, **other.blended},
        )
