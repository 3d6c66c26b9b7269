"""The sparse backend's figures as stats keys of kvreuse's connectors (the channel: ``kvreuse.vllm.metrics``).

Every step the worker's connector sends what the figures of this process's sparse attention grew by
(``kvreuse.sparse.figures.FigureIncrements``: on a GPU a step late, so that the host never waits for the device),
one key per figure and layer. vLLM adds them to these Prometheus counters, each with the label ``layer``:

* ``vllm:kvreuse_sparse_blocks_read_total``: KV blocks (x KV heads) whose keys and values decodes read;
* ``vllm:kvreuse_sparse_blocks_total``: KV blocks (x KV heads) in the contexts of those decodes;
* ``vllm:kvreuse_sparse_tokens_attended_total``, ``vllm:kvreuse_sparse_tokens_total``: the same for tokens (x query
  heads);
* ``vllm:kvreuse_sparse_dipr_decodes_total``, ``vllm:kvreuse_sparse_dense_decodes_total``: decodes (one sequence in
  one layer) that ran DIPR, and that the policy kept dense (the first ``dense_layers`` layers, contexts shorter
  than ``min_context``);
* ``vllm:kvreuse_sparse_recovery_kept_ppm_total``, ``vllm:kvreuse_sparse_recovery_samples_total``: the sum of the
  sampled recovery ratios (share of the dense attention mass kept, per query head) in millionths, and their number.

The names are in vLLM's namespace, as vLLM's own connectors name theirs (``vllm:nixl_*``, ``vllm:mooncake_*``):
``LLM.get_metrics()`` lists only ``vllm:`` metrics (``vllm.v1.metrics.reader``), and reads counters as integers,
hence the recovery in millionths. So the fraction of blocks a layer attends is
``rate(vllm:kvreuse_sparse_blocks_read_total[5m]) / rate(vllm:kvreuse_sparse_blocks_total[5m])``, and the mean
recovery ratio is ``kept_ppm / 1e6 / samples`` likewise. vLLM's log line shows them over all layers:
``sparse_block_fraction``, ``sparse_token_fraction``, ``sparse_recovery``, ``sparse_dipr_decodes``,
``sparse_dense_decodes``. Decodes the policy keeps dense count as reading every block and token; prefills are not
counted.
"""

from __future__ import annotations

from kvreuse.sparse.figures import FigureIncrements
from kvreuse.sparse.paged import SparseAttention

PREFIX = "sparse_"
PPM = 1e6  # the recovery ratios' sum is sent in millionths (see the module docstring)
# Stats name -> (Prometheus name, documentation, label name); stats keys are "<name>:<layer>".
SPARSE_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "sparse_blocks_read": (
        "vllm:kvreuse_sparse_blocks_read_total",
        "KV blocks (x KV heads) whose keys and values decodes read",
        "layer",
    ),
    "sparse_blocks_total": (
        "vllm:kvreuse_sparse_blocks_total",
        "KV blocks (x KV heads) in the contexts of decodes",
        "layer",
    ),
    "sparse_tokens_attended": (
        "vllm:kvreuse_sparse_tokens_attended_total",
        "Context tokens (x query heads) decodes attended",
        "layer",
    ),
    "sparse_tokens_total": (
        "vllm:kvreuse_sparse_tokens_total",
        "Context tokens (x query heads) of decodes",
        "layer",
    ),
    "sparse_dipr_decodes": (
        "vllm:kvreuse_sparse_dipr_decodes_total",
        "Decodes (sequence x layer) that ran DIPR sparse attention",
        "layer",
    ),
    "sparse_dense_decodes": (
        "vllm:kvreuse_sparse_dense_decodes_total",
        "Decodes (sequence x layer) the policy kept dense (dense_layers, contexts under min_context)",
        "layer",
    ),
    "sparse_recovery_kept_ppm": (
        "vllm:kvreuse_sparse_recovery_kept_ppm_total",
        "Sum of the sampled recovery ratios (dense attention mass kept, per query head), in millionths",
        "layer",
    ),
    "sparse_recovery_samples": (
        "vllm:kvreuse_sparse_recovery_samples_total",
        "Query heads whose recovery ratio was sampled",
        "layer",
    ),
}


def sparse_increments(attention: SparseAttention | None, increments: FigureIncrements) -> dict[str, float]:
    """What ``attention``'s figures grew by since ``increments`` last looked, as stats keys
    ``sparse_<figure>:<layer>`` (empty without the backend, or when nothing grew)."""
    if attention is None:
        return {}
    out: dict[str, float] = {}
    for (name, layer), value in increments.take(attention.figures).items():
        if name == "recovery_kept":
            name, value = "recovery_kept_ppm", round(value * PPM)
        out[f"{PREFIX}{name}:{layer}"] = value
    return out


def sparse_fractions(data: dict[str, float]) -> dict[str, float]:
    """The fractions over all layers and the decode counts, for vLLM's log line (only those with data)."""
    total = {name.removeprefix(PREFIX): 0.0 for name in SPARSE_COUNTERS}
    for key, value in data.items():
        name = key.partition(":")[0].removeprefix(PREFIX)
        if key.startswith(PREFIX) and name in total:
            total[name] += value
    out: dict[str, float] = {}
    for label, part, whole, unit in (
        ("block_fraction", "blocks_read", "blocks_total", 1),
        ("token_fraction", "tokens_attended", "tokens_total", 1),
        ("recovery", "recovery_kept_ppm", "recovery_samples", PPM),
    ):
        if total[whole]:
            out[PREFIX + label] = round(total[part] / unit / total[whole], 4)
    for name in ("dipr_decodes", "dense_decodes"):
        if total[name]:
            out[PREFIX + name] = int(total[name])
    return out
