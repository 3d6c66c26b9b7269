"""Comparing the greedy generations of two engines (or code paths) that compute the same float32 model with different
operations: the stock attention and kvreuse's, the Triton kernels and their PyTorch references, a module's KV spliced
from the cache and recomputed.

Their logits differ by rounding (``tests/numerics.py`` says why no two implementations agree bitwise), so their greedy
argmax is promised to agree only where the reference's best token leads every other by more than rounding can move
the two apart: a step is *decided* when the reference's lead over the candidate's pick exceeds
``2 * LOGPROB_TOLERANCE``. The candidate must follow the reference at every decided step, each chosen token's
log-probability within ``LOGPROB_TOLERANCE`` of the reference's; at an undecided step where they pick differently the
two generations legitimately part, and the comparison ends there. Random weights give near-uniform next-token
distributions, so such near-ties do occur: asserting equal tokens instead makes a test pass or fail by the last bit.

``LOGPROB_TOLERANCE``: a float32 sum of ``n`` terms has a rounding error of order ``sqrt(n) u`` times the terms'
magnitude (``u = 6e-8``; Higham and Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
Comput. 41, 2019). The small model's longest sums have ``n <= 2,048`` terms (attention over prompts of up to ~1,600
tokens, the MLP's 512, the hidden size 256) of magnitude below ~10, so a logit moves by ~3e-5 per layer, ~1e-4 through
its two layers and the LM head, and a log-probability (the logit minus a log-sum-exp of such logits) by at most twice
that. ``1e-3`` is several times that, and still a hundredth of what attending to the wrong keys and values changes
(~0.1 to 1 nat: a module spliced without its context moves the first token's log-probabilities by 0.28 on average).
"""

from __future__ import annotations

LOGPROB_TOLERANCE = 1e-3
LOGPROBS = 5


def assert_same_greedy_path(reference, candidate, what: str) -> int:
    """``reference`` and ``candidate``: vLLM ``CompletionOutput``s of the same prompt, generated greedily with
    ``SamplingParams(logprobs=LOGPROBS)`` (the reference's leading tokens at each step: a pick outside them is no
    near-tie). Returns the number of steps compared (all of them unless the two parted at a near-tie)."""
    assert reference.logprobs and candidate.logprobs, f"{what}: generate with SamplingParams(logprobs=LOGPROBS)"
    largest = 0.0
    for step, (ours, theirs) in enumerate(zip(candidate.token_ids, reference.token_ids)):
        mine, want = candidate.logprobs[step], reference.logprobs[step]
        if ours == theirs:
            gap = abs(mine[ours].logprob - want[theirs].logprob)
            largest = max(largest, gap)
            assert gap <= LOGPROB_TOLERANCE, (
                f"{what}: step {step}, token {ours}: log-probability {mine[ours].logprob:.6f} against the "
                f"reference's {want[theirs].logprob:.6f} (|difference| {gap:.2g} > {LOGPROB_TOLERANCE})"
            )
            continue
        lead = want[theirs].logprob - want[ours].logprob if ours in want else float("inf")
        assert lead <= 2 * LOGPROB_TOLERANCE, (
            f"{what}: step {step}: token {ours} where the reference chose {theirs}, which led it by "
            f"{lead:.3g} nats (> {2 * LOGPROB_TOLERANCE}: a decided step)"
        )
        print(f"{what}: parted at step {step} (a near-tie); log-probabilities apart by {largest:.2g} at most before")
        return step
    assert len(candidate.token_ids) == len(reference.token_ids), f"{what}: lengths differ"
    print(f"{what}: {len(reference.token_ids)} steps alike, log-probabilities apart by {largest:.2g} at most")
    return len(reference.token_ids)


def assert_decided(reference, what: str) -> None:
    """Every step of ``reference`` is decided: its token leads the runner-up by more than ``2 * LOGPROB_TOLERANCE``.
    A test that needs two generations to stay together to the end (to compare what they counted on the way) checks
    this premise of its prompts; it holds or fails alike on every machine, as planted data's margins do."""
    for step, (token, logprobs) in enumerate(zip(reference.token_ids, reference.logprobs)):
        runner_up = max((lp.logprob for t, lp in logprobs.items() if t != token), default=float("-inf"))
        lead = logprobs[token].logprob - runner_up
        assert lead > 2 * LOGPROB_TOLERANCE, (
            f"{what}: step {step} is a near-tie (token {token} leads by {lead:.2g} nats): choose a prompt without one"
        )
