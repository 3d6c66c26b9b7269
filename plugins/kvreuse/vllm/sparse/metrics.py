"""The sparse backend's figures as stats keys of kvreuse's connectors (the channel: ``kvreuse.vllm.metrics``).

Every step the worker's connector sends what the figures of this process's sparse attention grew by
(``kvreuse.sparse.figures.FigureIncrements``: on a GPU a step late, so that the host never waits for the device),
one key per figure and layer. vLLM adds them to these Prometheus counters, each with the label ``layer``:

* ``kvreuse:sparse_blocks_read_total``: KV blocks (x KV heads) whose keys and values decodes read;
* ``kvreuse:sparse_blocks_total``: KV blocks (x KV heads) in the contexts of those decodes;
* ``kvreuse:sparse_tokens_attended_total``, ``kvreuse:sparse_tokens_total``: the same for tokens (x query heads);
* ``kvreuse:sparse_recovery_kept_total``, ``kvreuse:sparse_recovery_samples_total``: the sum of the sampled
  recovery ratios (share of the dense attention mass kept, per query head) and their number.

So the fraction of blocks a layer attends is ``rate(kvreuse:sparse_blocks_read_total[5m]) /
rate(kvreuse:sparse_blocks_total[5m])``, and the mean recovery ratio is ``kept / samples`` likewise. vLLM's log
line shows them over all layers: ``sparse_block_fraction``, ``sparse_token_fraction``, ``sparse_recovery``.
Decodes the policy keeps dense (short contexts, the first layers) count as reading every block and token; prefills
are not counted.
"""

from __future__ import annotations

from kvreuse.sparse.figures import FIGURES, FigureIncrements
from kvreuse.sparse.paged import SparseAttention

PREFIX = "sparse_"
# Stats name -> (Prometheus name, documentation, label name); stats keys are "<name>:<layer>".
SPARSE_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "sparse_blocks_read": (
        "kvreuse:sparse_blocks_read_total",
        "KV blocks (x KV heads) whose keys and values decodes read",
        "layer",
    ),
    "sparse_blocks_total": (
        "kvreuse:sparse_blocks_total",
        "KV blocks (x KV heads) in the contexts of decodes",
        "layer",
    ),
    "sparse_tokens_attended": (
        "kvreuse:sparse_tokens_attended_total",
        "Context tokens (x query heads) decodes attended",
        "layer",
    ),
    "sparse_tokens_total": ("kvreuse:sparse_tokens_total", "Context tokens (x query heads) of decodes", "layer"),
    "sparse_recovery_kept": (
        "kvreuse:sparse_recovery_kept_total",
        "Sum of the sampled recovery ratios (dense attention mass kept, per query head)",
        "layer",
    ),
    "sparse_recovery_samples": (
        "kvreuse:sparse_recovery_samples_total",
        "Query heads whose recovery ratio was sampled",
        "layer",
    ),
}


def sparse_increments(attention: SparseAttention | None, increments: FigureIncrements) -> dict[str, float]:
    """What ``attention``'s figures grew by since ``increments`` last looked, as stats keys
    ``sparse_<figure>:<layer>`` (empty without the backend, or when nothing grew)."""
    if attention is None:
        return {}
    return {f"{PREFIX}{name}:{layer}": value for (name, layer), value in increments.take(attention.figures).items()}


def sparse_fractions(data: dict[str, float]) -> dict[str, float]:
    """The fractions over all layers, for vLLM's log line (only those whose totals are not zero)."""
    total = {name: 0.0 for name in FIGURES}
    for key, value in data.items():
        name = key.partition(":")[0].removeprefix(PREFIX)
        if key.startswith(PREFIX) and name in total:
            total[name] += value
    out: dict[str, float] = {}
    for label, part, whole in (
        ("block_fraction", "blocks_read", "blocks_total"),
        ("token_fraction", "tokens_attended", "tokens_total"),
        ("recovery", "recovery_kept", "recovery_samples"),
    ):
        if total[whole]:
            out[PREFIX + label] = round(total[part] / total[whole], 4)
    return out
