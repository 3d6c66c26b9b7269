"""The module cache's counters as stats keys of kvreuse's connectors (the channel: ``kvreuse.vllm.metrics``).

Each worker sends the increments of its counters every step (``ModuleWorker.take_increments``); vLLM logs them
with its other KV-transfer figures (``KV Transfer metrics: tokens_loaded=..., hits:gpu=...``) and, where it runs a
Prometheus logger, adds them to these counters:

* ``kvreuse:module_hits_total`` (label ``tier``), ``kvreuse:module_misses_total``;
* ``kvreuse:module_tokens_loaded_total``, ``kvreuse:module_pieces_loaded_total``,
  ``kvreuse:module_load_failures_total``;
* ``kvreuse:module_encoded_total``, ``kvreuse:module_encode_failures_total``;
* ``kvreuse:module_bytes_moved_total`` (label ``move``, e.g. ``cpu->gpu``), ``kvreuse:module_evictions_total``
  (label ``tier``), ``kvreuse:module_drops_total``;
* ``kvreuse:module_splice_skipped_total`` (label ``reason``, see ``kvreuse.modules.splice.SkipReason``) and
  ``kvreuse:module_writes_refused_total`` (label ``reason``, see ``kvreuse.vllm.modules.scheduler.WriteRefusal``),
  counted by the scheduler side;
* ``kvreuse:module_encodings_taken_total`` (label ``match``, see ``kvreuse.modules.encodings.EncodingMatch``):
  module pieces spliced into requests, by how the stored encoding taken fits the prompt (``exact``: encoded after
  this prompt's own tokens, a full prefill's KV; ``context``: after the prompt's start and/or the tokens right
  before it; ``alone``: encoded without a context; ``unmatched``: the module's first encoding, whose context is not
  in this prompt), counted by the scheduler side;
* ``kvreuse:module_shadow_checks_total`` and ``kvreuse:module_shadow_agreed_total``: shadow pairs compared (a
  spliced request and its full-prefill copy, ``kvreuse.vllm.modules.shadow``) and those whose first tokens agreed,
  counted by the scheduler side.

Every counter of :data:`STARTUP_KEYS` shows on ``/metrics`` at 0 from the engine's start (a Prometheus counter with
labels shows nothing until a child is made), so an operator can tell "none yet" from "not counted".
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvreuse.modules.encodings import EncodingMatch
from kvreuse.modules.splice import SkipReason
from kvreuse.modules.store import StoreFigures

# Stats name -> (Prometheus name, documentation, label name or None). A labelled counter's stats keys are
# "<name>:<label value>".
MODULE_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "hits": ("kvreuse:module_hits_total", "Module look-ups answered, by the tier that held the module", "tier"),
    "misses": ("kvreuse:module_misses_total", "Module look-ups of modules the store did not hold", None),
    "tokens_loaded": (
        "kvreuse:module_tokens_loaded_total",
        "Prompt tokens whose KV was written from cached modules",
        None,
    ),
    "pieces_loaded": ("kvreuse:module_pieces_loaded_total", "Module pieces written into requests", None),
    "load_failures": (
        "kvreuse:module_load_failures_total",
        "Module pieces that could not be loaded (recomputed)",
        None,
    ),
    "modules_encoded": ("kvreuse:module_encoded_total", "Modules encoded and stored", None),
    "encode_failures": ("kvreuse:module_encode_failures_total", "Encoded modules the store refused", None),
    "bytes_moved": ("kvreuse:module_bytes_moved_total", "Bytes of module KV moved between tiers", "move"),
    "evictions": ("kvreuse:module_evictions_total", "Modules moved out of a full tier", "tier"),
    "drops": ("kvreuse:module_drops_total", "Modules that left the store to make room", None),
    "splice_skipped": (
        "kvreuse:module_splice_skipped_total",
        "Registered modules found in a prompt (or all but their last token) but not spliced, by reason",
        "reason",
    ),
    "writes_refused": (
        "kvreuse:module_writes_refused_total",
        "Encode requests whose module was not stored: no valid write proof (unproven, expired, replayed, "
        "nonces_full), or malformed parameters",
        "reason",
    ),
    "encodings_taken": (
        "kvreuse:module_encodings_taken_total",
        "Module pieces spliced into requests, by how the encoding taken fits the prompt (exact, context, alone, "
        "unmatched)",
        "match",
    ),
    "shadow_checks": (
        "kvreuse:module_shadow_checks_total",
        "Shadow pairs compared: a spliced request and the same prompt computed in full",
        None,
    ),
    "shadow_agreed": (
        "kvreuse:module_shadow_agreed_total",
        "Shadow pairs whose first output tokens agreed with full prefill's",
        None,
    ),
}


def module_counter_values(figures: Any, store: StoreFigures) -> dict[str, int]:
    """The worker's and its store's counters as flat stats keys (see :data:`MODULE_COUNTERS`)."""
    out = {name: value for name, value in asdict(figures).items() if name in MODULE_COUNTERS}
    out.update(misses=store.misses, drops=store.drops)
    for name in ("hits", "bytes_moved", "evictions"):
        for label, value in getattr(store, name).items():
            out[f"{name}:{label}"] = value
    return out


# Stats keys whose counters show at 0 from start-up: every counter without a label of its own, the skipped splices
# by each reason and the encodings taken by each match (the other labels' values, tiers and moves, depend on the
# store's configuration).
STARTUP_KEYS: tuple[str, ...] = (
    *(name for name, (_, _, label) in MODULE_COUNTERS.items() if label is None),
    *(f"splice_skipped:{reason}" for reason in SkipReason),
    *(f"encodings_taken:{match}" for match in EncodingMatch),
)
