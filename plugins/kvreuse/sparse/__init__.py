"""DIPR sparse decode attention, engine-free: settings, the per-layer/per-sequence policy and the figures.

The kernels are in ``kvreuse.kernels.key_sketch`` (per-token 8-bit key codes, written with every key) and
``kvreuse.kernels.dipr_decode`` (the split-K decode that skips blocks by the bounds those codes give); an engine
adapter calls them through ``kvreuse.sparse.paged.SparseAttention`` with its own metadata.
"""

from kvreuse.sparse.config import SparseConfig, parse_layer_betas
from kvreuse.sparse.figures import AttendedFractions, FigureIncrements, recovery_ratio, sample_recovery, should_sample
from kvreuse.sparse.policy import RuleBasedPolicy, layer_beta, sequence_betas, uses_dipr

__all__ = [
    "AttendedFractions",
    "FigureIncrements",
    "RuleBasedPolicy",
    "SparseConfig",
    "layer_beta",
    "parse_layer_betas",
    "recovery_ratio",
    "sample_recovery",
    "sequence_betas",
    "should_sample",
    "uses_dipr",
]
