"""What crosses between the sides of the module-cache connector: the encode request's parameters (client ->
scheduler), the per-step metadata (scheduler -> worker) and the worker's report (worker -> scheduler).

Both sides import this module, never each other (nor the connector facade), as in vLLM's own ``OffloadingConnector``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvreuse.errors import ModuleRegistrationError
from kvreuse.modules.splice import Piece
from kvreuse.modules.store import ModuleKey

# The keys of an encode request's kv_transfer_params.
ENCODE_MODULE = "kvreuse_module"
ENCODE_CONTEXT = "kvreuse_context"


def encode_params(name: str, context_tokens: int = 0) -> dict[str, Any]:
    """The ``kv_transfer_params`` of an encode request for module ``name`` after ``context_tokens`` tokens."""
    return {ENCODE_MODULE: name, ENCODE_CONTEXT: int(context_tokens)}


def marks_encode(params: Mapping[str, Any] | None) -> bool:
    """Whether a request's ``kv_transfer_params`` make it an encode request (well formed or not)."""
    return params is not None and ENCODE_MODULE in params


def encode_request(params: Mapping[str, Any] | None, num_prompt_tokens: int) -> tuple[Hashable, int] | None:
    """``(module name, context length)`` if ``kv_transfer_params`` mark an encode request, else ``None``.

    Raises :class:`ModuleRegistrationError` for malformed parameters (the request then runs as a plain one).
    """
    if params is None or not marks_encode(params):
        return None
    name, context = params[ENCODE_MODULE], params.get(ENCODE_CONTEXT, 0)
    if not isinstance(name, str) or not name:
        raise ModuleRegistrationError(f"{ENCODE_MODULE} must be a non-empty string, got {name!r}")
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context < num_prompt_tokens:
        raise ModuleRegistrationError(
            f"{ENCODE_CONTEXT} of module {name!r} must be an integer in "
            f"0..{num_prompt_tokens - 1} (the prompt has {num_prompt_tokens} tokens), "
            f"got {context!r}"
        )
    return name, context


@dataclass(frozen=True)
class LoadSpec:
    """Write these pieces (``Piece.name`` is a :class:`ModuleKey`) into request ``req_id``'s slots."""

    req_id: str
    pieces: tuple[Piece, ...]
    slots: tuple[tuple[int, ...], ...]  # per piece, the slot of each of its tokens
    blocks: tuple[tuple[int, ...], ...]  # per piece, the blocks its tokens lie in (reported if it fails)


@dataclass(frozen=True)
class SaveSpec:
    """After this step, copy tokens at ``slots`` of request ``req_id`` into the store as module ``name``."""

    req_id: str
    name: Hashable
    token_ids: tuple[int, ...]
    start: int  # position of the module's first token (the context's length)
    slots: tuple[int, ...]


@dataclass
class ModuleCacheMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    prefetch: list[ModuleKey] = field(default_factory=list)  # modules waiting requests will load, in order


@dataclass
class ModuleCacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: what entered and left the store.

    With tensor parallelism each worker stores its own heads' share; a module is usable once every worker stored
    it, and unusable as soon as one lost it, so aggregation intersects ``stored`` and unites ``dropped``.
    """

    stored: dict[ModuleKey, tuple[int, ...]] = field(default_factory=dict)
    dropped: set[ModuleKey] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # module name -> why its encoding was not stored

    def aggregate(self, other: ModuleCacheWorkerMeta) -> ModuleCacheWorkerMeta:
        return ModuleCacheWorkerMeta(
            stored={key: ids for key, ids in self.stored.items() if key in other.stored},
            dropped=self.dropped | other.dropped,
            failed={**self.failed, **other.failed},
        )
