"""Settings of the ``sparse`` plugin (DIPR sparse decode attention).

``beta`` is in softmax-logit units (scores already multiplied by the softmax scale, usually ``1/sqrt(head_dim)``):
DIPR keeps the tokens whose attention weight is at least ``exp(-beta)`` times the largest weight. AlayaDB's
``beta`` on raw inner products is ours times ``sqrt(head_dim)``; an ``alpha`` weight ratio is ``beta = -ln(alpha)``.

Default ``beta = 8`` (``alpha = e^-8 ~ 3.4e-4``). On the synthetic structured keys of ``benchmarks/sparse_bytes.py``
it keeps >= 97.9% of the dense attention mass at 4K-32K tokens while reading 16-33% fewer K/V bytes (block size
16); ``beta = 12`` read every block there (so only paid for the bounds); ``beta = 4-6`` read 2x (4K) to 5-8x
(32K) fewer bytes. The worst case is weaker: dropping ``n`` tokens loses at most ``n e^-beta / (1 + n e^-beta)``
of the mass (if every dropped token sat just below the cut-off), so ``beta = ln(n / eps)`` is needed to guarantee
a loss below ``eps`` at context ``n``. Real attention is far from that worst case, but the safe beta depends on the
model and task: measure it with ``sample_recovery``, set it per layer with ``layer_betas``; ``inf`` is exact.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvreuse import config
from kvreuse.errors import ConfigError

CPU_MIN_CONTEXT = 8192
"""``min_context``'s default on a CPU engine (a setting given by flag or variable wins). Measured on vLLM's CPU
engine with SmolLM2 (docs: the sparse benchmarks, "Shorter contexts and min_context"): vLLM's CPU op is
compute-bound and DIPR's decision (the sketch scan, 14-20% of the dense attention it prunes) is paid at every length,
so the default beta = 8 decoded slower than stock at 2K and 4K (1.18x and 1.03x stock's time per token, reading 75%
and 62% of the blocks) and faster from 8K on (0.87x at 8K, 0.76x at 16K with RoPE extended); beta = 4 was faster
from 4K (0.89x; 1.07x at 2K). So contexts under 8K stay dense on a CPU by default (stock's speed and answers); set
``min_context`` to 4096 with beta = 4. A GPU, where the scan saves HBM bytes, keeps the general default."""


def parse_layer_betas(text: str) -> dict[int, float]:
    """``"0:inf,3:6.0,8-11:10"`` -> ``{0: inf, 3: 6.0, 8: 10.0, ..., 11: 10.0}``; ``""`` -> ``{}``.

    Raises ``ConfigError`` naming ``sparse.layer_betas`` for a malformed entry, a negative beta or a layer given
    twice.
    """
    where = f"sparse.layer_betas ({config.env_name('sparse', 'layer_betas')})"
    out: dict[int, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        layers, sep, value = entry.partition(":")
        try:
            first, _, last = layers.strip().partition("-")
            span = range(int(first), int(last or first) + 1)
            beta = float(value)
        except ValueError:
            span, beta = range(0), float("nan")
        if not sep or not span or span.start < 0 or math.isnan(beta) or beta < 0:
            raise ConfigError(
                f"{where}: {entry!r} is not LAYER:BETA or FIRST-LAST:BETA with layers >= 0 and beta in [0, inf]"
            )
        for layer in span:
            if layer in out:
                raise ConfigError(f"{where}: layer {layer} is given twice")
            out[layer] = beta
    return out


@dataclass(frozen=True)
class SparseConfig:
    """Settings of DIPR sparse decode attention; see the README's table of flags.

    In vLLM they are read from ``--additional-config '{"kvreuse": {"sparse": {...}}}'`` or ``KVREUSE_SPARSE_*``.
    """

    beta: float = config.setting(
        8.0,
        "DIPR: keep tokens whose softmax logit is within beta of the largest (weight >= e^-beta of the "
        "strongest); inf = dense",
        low=0.0,
    )
    layer_betas: str = config.setting(
        "", 'per-layer beta overrides, e.g. "0:inf,8-11:6.0" (a layer listed here ignores dense_layers)'
    )
    dense_layers: int = config.setting(
        1,
        "the first this many layers always use dense attention (SmolLM2's layer 0 needs 80-99% of blocks at beta 4)",
        low=0,
        high=1_000_000,
    )
    min_context: int = config.setting(
        512,
        "sequences shorter than this many tokens use dense attention (logged once when it happens)",
        low=0,
        high=config.MAX_TOKENS,
    )
    sink: int = config.setting(
        16, "always-kept first tokens; their scores give DIPR's lower bound on the largest score", low=0, high=1_000_000
    )
    local: int = config.setting(
        64, "always-kept last tokens (with sink; at least one window token in all)", low=0, high=1_000_000
    )
    sample_recovery: int = config.setting(
        0,
        "every this many decode steps, measure the share of dense attention mass kept (0 = never)",
        low=0,
        high=config.MAX_TOKENS,
    )
    top_pages: int = config.setting(
        0,
        "approximate, opt-in: each KV head of a DIPR decode reads the window's blocks and at most this many others, "
        "those whose sketch bound reaches furthest above DIPR's threshold (Quest's top pages); keys within beta of "
        "the largest may be dropped, so calibrate it on your own prompts (kvreuse calibrate-sparse) (0 = off: exact "
        "DIPR; vLLM's CPU engine kernel path only)",
        low=0,
        high=1_000_000,
    )
    engine_kernel: bool = config.setting(
        True,
        "exact attention by the engine's own kernel, DIPR choosing the blocks each KV head reads: vLLM's CPU "
        "attention ops on CPU_ATTN's KV layout (CPU build), vLLM's FlashAttention over pruned block tables (GPU) "
        "(false: kvreuse's own attention, PyTorch on CPU, Triton on GPU; read at start; with the module cache's "
        "connector false on a GPU, and on a CPU whose CPU_ATTN key tiles kvreuse does not read)",
    )

    def __post_init__(self) -> None:
        self.layer_beta_overrides  # noqa: B018 (parsed, hence checked, at construction)
        if self.sink + self.local < 1:
            raise ConfigError(
                f"sparse.sink ({config.env_name('sparse', 'sink')}) and sparse.local "
                f"({config.env_name('sparse', 'local')}): at least one must be >= 1, the window gives "
                f"DIPR its lower bound on the largest score"
            )

    @cached_property
    def layer_beta_overrides(self) -> dict[int, float]:
        """``layer_betas`` parsed, once per config: every user of the overrides reads them here."""
        return parse_layer_betas(self.layer_betas)

    @classmethod
    def load(
        cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None, *, cpu: bool = False
    ) -> SparseConfig:
        """The settings from defaults, ``KVREUSE_SPARSE_*`` variables and ``flags``; on a ``cpu`` engine
        ``min_context`` defaults to :data:`CPU_MIN_CONTEXT` unless one of them sets it."""
        loaded = config.load(cls, "sparse", flags, environ)
        environ = os.environ if environ is None else environ
        if cpu and "min_context" not in (flags or {}) and config.env_name("sparse", "min_context") not in environ:
            return dataclasses.replace(loaded, min_context=CPU_MIN_CONTEXT)
        return loaded
