"""APE's attention over spliced module keys, engine-free: what the sparse backend computes for a request whose
modules were spliced with APE on.

APE (Yang, Chen, Chen, "APE: Faster and Longer Context-Augmented Generation via Adaptive Parallel Encoding",
ICLR 2025) lets the tokens after independently encoded contexts attend to them with an attention temperature
``T`` and a scaling factor ``S``: for a query after the modules, ``logit = q.k / (sqrt(d) * T) + log(S)`` on a
module key and the plain ``q.k / sqrt(d)`` elsewhere, before one softmax over all keys. ``T < 1`` sharpens the
attention among module tokens; ``S`` multiplies their attention mass against the prefix's and the new tokens'.
Both fold into the keys and one additive bias (keys at module positions divided by ``T``, ``log(S)`` added to
their logits), so the attention stays one fused ``scaled_dot_product_attention`` call.

Which queries: those at or after the end of the spliced run (the question, decoded tokens). Tokens inside the
run that a step computes (module recompute) keep plain attention: their KV is what a prefill of the prompt
before them gives, as in the offline reference (``benchmarks/splice_reference.py``, ``ApeBias``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

OFF = (1.0, 1.0)  # (temperature, scale) that change nothing


@dataclass(frozen=True)
class ApeSpans:
    """One request's APE: the prompt positions ``[start, end)`` of its spliced module tokens (ascending,
    disjoint), and the temperature and scale its later tokens attend to them with."""

    ranges: tuple[tuple[int, int], ...]
    temperature: float
    scale: float

    def __post_init__(self) -> None:
        check_ape(self.temperature, self.scale, "APE spans")  # no factor past the bounds reaches the attention

    @property
    def after(self) -> int:
        """The first position whose queries attend with APE (the end of the last module)."""
        return max((end for _, end in self.ranges), default=0)

    def module_keys(self, length: int, device: torch.device | str) -> torch.Tensor:
        """``[length]`` bool: which of a sequence's first ``length`` positions hold module tokens."""
        mask = torch.zeros(length, dtype=torch.bool, device=device)
        for start, end in self.ranges:
            mask[start:end] = True
        return mask


# The settings' bounds come from the arithmetic they feed (issue 26: a request's T = 1e-300 made ``1 / T`` overflow
# and killed the engine; T = 5e-324 left NaN KV behind). APE's late queries attend in fp32 (``ape_attend``):
# - T: the module logits are multiplied by 1 / T <= 2**8, which uses 8 of fp32's 127 binary orders of magnitude
#   above the plain logits; a trained model's logits lie far below fp32's limit (SmolLM2-135M's real keys and
#   queries, tests/data/smollm2_keys.pt: |logit| < 26), so the scaled logits stay finite. Past 2**8 either way
#   fp32's softmax is saturated anyway: at T = 2**-8 a logit gap of 0.41 already gives a weight ratio of e**-104,
#   below fp32's smallest number, and at T = 2**8 every module logit within 26 of another weighs the same to 10%.
# - S: log(S) is added to the module logits; S and 1 / S are normal fp32 numbers (|log S| < 88: the module keys'
#   attention mass changes by a factor fp32 can hold), and the bias is exact in every logit dtype (fp16: 65504).
MIN_TEMPERATURE, MAX_TEMPERATURE = 2.0**-8, 2.0**8
MIN_SCALE, MAX_SCALE = 2.0**-126, 2.0**126


def check_ape(temperature: object, scale: object, where: str) -> tuple[float, float]:
    """``(temperature, scale)`` as floats if each is a number within its bounds (``MIN_TEMPERATURE`` ..
    ``MAX_TEMPERATURE``, ``MIN_SCALE`` .. ``MAX_SCALE``); else a ``ValueError`` whose message names ``where`` (the
    setting or parameter the values came from), the field and its range."""
    values = []
    for name, value, low, high in (
        ("temperature", temperature, MIN_TEMPERATURE, MAX_TEMPERATURE),
        ("scale", scale, MIN_SCALE, MAX_SCALE),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise ValueError(
                f"{where}: {name} must be a number from {low:.3g} to {high:.3g} (1 = off), got {repr(value)[:32]}"
            )
        values.append(float(value))
    return values[0], values[1]


def ape_attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    spans: ApeSpans,
    scale: float,
) -> torch.Tensor:
    """``query[q_len, q_heads, d]``, the tokens at sequence ``positions[q_len]``, attending to ``keys``/``values
    [seq_len, kv_heads, d]`` at or before their own position, those at or after ``spans.after`` with APE on the
    module keys: ``[q_len, q_heads, d]`` in the query's dtype."""
    seq_len = keys.shape[0]
    device = query.device
    positions = positions.to(device)
    visible = torch.arange(seq_len, device=device)[None, :] <= positions[:, None]
    late = positions >= spans.after
    out = torch.empty_like(query)
    if not bool(late.all()):
        out[~late] = _attend(query[~late], keys.to(query.dtype), values.to(query.dtype), visible[~late], scale)
    if bool(late.any()):
        # In fp32 whatever the model's dtype: 1 / T on a key stored in fp16 or bf16 could leave the key's dtype.
        module = spans.module_keys(seq_len, device)
        factor = torch.where(module, 1.0 / spans.temperature, 1.0).float()
        bias = torch.zeros(visible[late].shape, dtype=torch.float32, device=device)
        bias[:, module] = math.log(spans.scale)
        bias.masked_fill_(~visible[late], float("-inf"))
        attended = _attend(query[late].float(), keys.float() * factor[:, None, None], values.float(), bias, scale)
        out[late] = attended.to(out.dtype)
    return out


def _attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Fused attention of ``query[q, hq, d]`` over ``keys``/``values[n, kv, d]`` with ``mask[q, n]`` (bool: may
    attend; float: added to the logits)."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, keys, values))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
