"""kvreuse's live objects in one vLLM process, and the functions that read them there.

vLLM builds kvreuse's objects through its own callbacks (an attention layer's ``AttentionImpl``, a connector per
role) and calls them on different objects, so they meet in one handle per process, :class:`ProcessRuntime`: the
sparse backend puts its :class:`~kvreuse.sparse.paged.SparseAttention` there (one per process and engine: all layers
share its settings and figures), the module connector's worker side puts itself there. The connectors read it to
send the figures, and so does a caller in the worker process through the functions below (:func:`sparse_figures`,
:func:`module_figures`, :func:`configure_sparse`, ...), e.g. with ``LLM.collective_rpc``::

    def figures(worker):
        from kvreuse.vllm.runtime import sparse_figures

        return sparse_figures()

    llm.collective_rpc(figures)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvreuse.errors import ConfigError
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.figures import AttendedFractions
from kvreuse.sparse.paged import SparseAttention

if TYPE_CHECKING:
    import torch

    from kvreuse.modules.store import ModuleStore
    from kvreuse.sparse.ape import ApeSpans


class ModuleSide(Protocol):
    """What this handle reads of the module connector's worker side (``kvreuse.vllm.modules.worker.ModuleWorker``,
    which imports this module: the handle names only what it reads, so the two do not import each other)."""

    store: ModuleStore
    figures: Any  # a dataclass of counters (``ModuleFigures``)


@dataclass
class ProcessRuntime:
    """What kvreuse's plugins run in this process (``None``: that plugin does not run here)."""

    sparse_attention: SparseAttention | None = None
    sparse_owner: object | None = None  # the vLLM configuration of the engine that built ``sparse_attention``
    module_worker: ModuleSide | None = None
    # This step's token positions when module recompute moved some (host int64, one per scheduled token), else
    # None: set by the module connector's input wrapper, read by the sparse backend's metadata builder.
    step_positions: torch.Tensor | None = None
    # This step's APE per request in batch order (None for a request without), or None when no request of the step
    # has APE: set by the module connector's input wrapper, read by the sparse backend's metadata builder.
    step_ape: tuple[ApeSpans | None, ...] | None = None

    def sparse_attention_for(self, owner: object, build: Callable[[], SparseAttention]) -> SparseAttention:
        """The process's sparse attention for the engine configured by ``owner``, built by the engine's first
        layer (an in-process engine started after another gets its own settings and figures)."""
        if self.sparse_attention is None or self.sparse_owner is not owner:
            self.sparse_attention = build()
            self.sparse_owner = owner
        return self.sparse_attention


_RUNTIME = ProcessRuntime()


def runtime() -> ProcessRuntime:
    """This process's handle."""
    return _RUNTIME


def sparse_attention() -> SparseAttention | None:
    """This process's ``SparseAttention`` (``None`` until the backend's first layer is built)."""
    return _RUNTIME.sparse_attention


def sparse_figures() -> list[dict[str, Any]]:
    """Rows of the attended fractions per layer in this process (``AttendedFractions.rows``)."""
    attention = _RUNTIME.sparse_attention
    return [] if attention is None else attention.figures.rows()


def reset_sparse_figures() -> None:
    """Start this process's sparse figures afresh."""
    if _RUNTIME.sparse_attention is not None:
        _RUNTIME.sparse_attention.figures = AttendedFractions()


def configure_sparse(flags: Mapping[str, Any]) -> SparseConfig:
    """Replace this process's sparse settings between steps (``flags`` as in ``additional_config``; unset ones take
    their defaults on the engine's device, as at start)."""
    if _RUNTIME.sparse_attention is None:
        raise ConfigError("the kvreuse sparse attention backend is not running in this process")
    from kvreuse.patches import vllm_0_32

    config = SparseConfig.load(flags, cpu=vllm_0_32.device_type(_RUNTIME.sparse_owner) == "cpu")
    _RUNTIME.sparse_attention.configure(config)
    return config


def module_worker() -> ModuleSide | None:
    """This process's module-cache worker side (its ``store``, ``layers`` and ``last_loads``), if any."""
    return _RUNTIME.module_worker


def module_figures() -> dict[str, Any]:
    """This worker's module-cache counters and its store's, as plain values (``{}`` without the connector)."""
    worker = _RUNTIME.module_worker
    if worker is None:
        return {}
    store = worker.store
    figures = store.figures
    return {
        **asdict(worker.figures),
        "modules": len(store),
        "used_bytes": store.used_bytes(),
        "hits": dict(figures.hits),
        "misses": figures.misses,
        "bytes_moved": dict(figures.bytes_moved),
        "evictions": dict(figures.evictions),
        "drops": figures.drops,
        "store_load_failures": figures.load_failures,
        "prefetched": figures.prefetched,
    }
