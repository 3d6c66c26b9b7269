"""The sparse backend with kvreuse's own kernels on the plain layout in the real CPU engine, on the small model.

``sparse.engine_kernel`` false: what the backend runs on a GPU and beside the module cache's connector (the plain
LBNHC layout, kvreuse's PyTorch attention on a CPU, the Triton kernels on a GPU). One engine with DIPR in every layer
(``dense_layers = 0``, ``min_context = 0``) and ``TRITON_INTERPRET=1``, so that its worker can switch to the Triton
path a GPU runs (the cache write, key sketch, paged causal and DIPR kernels, in Triton's interpreter) on vLLM's own
tensors and metadata.
"""

from __future__ import annotations

import pytest
from greedy import LOGPROBS, assert_decided, assert_same_greedy_path
from real_engine import start_llm, stop_llm

pytestmark = pytest.mark.engine

WORDS = ("movie", "review", "the", "plot", "was", "slow", "but", "actors", "shine", "in", "every", "scene")
PROMPT = " ".join(WORDS[(7 + j) % len(WORDS)] + str(j % 6) for j in range(250))
LONG_PROMPT = " ".join(f"{WORDS[j % len(WORDS)]}{j}" for j in range(600))  # ~1,600 tokens
OWN_KERNELS = {"beta": float("inf"), "min_context": 0, "dense_layers": 0, "engine_kernel": False}


def greedy(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], [len(o.prompt_token_ids) for o in outs]


def _configure(flags, kernels):
    """A function for ``collective_rpc``: new sparse settings, empty figures, and the Triton kernels on or off
    (``None``: on CUDA tensors only, i.e. off here) in the worker."""

    def call(worker):
        from kvreuse.vllm import runtime

        runtime.configure_sparse(flags)
        runtime.reset_sparse_figures()
        runtime.sparse_attention().kernels = kernels

    return call


def _figures(llm):
    def call(worker):
        from kvreuse.vllm.runtime import sparse_figures

        return sparse_figures()

    return llm.collective_rpc(call)[0]


@pytest.fixture(scope="module")
def own_kernels_llm(small_model):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        mp.setenv("TRITON_INTERPRET", "1")  # read when the worker first imports a kernel
        # so the worker is a process of its own, which imports the kernels afresh (the suite's process imported them
        # without the interpreter: the Triton path then fails in an in-process worker)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        llm = start_llm(small_model, additional_config={"kvreuse": {"sparse": OWN_KERNELS}})
        try:
            yield llm
        finally:
            stop_llm(llm)
            if not overridden:  # in-process engines of later modules must get the stock CPU_ATTN again
                AttentionBackendEnum.CPU_ATTN.clear_override()


def test_the_triton_path_in_the_engine_gives_the_pytorch_paths_tokens_and_figures(own_kernels_llm):
    """The kernels a GPU runs, fed by the real engine: the greedy tokens and attended fractions of the CPU path (the
    reference), at a finite beta with DIPR in every layer. (Random weights; about 20 s in the interpreter.) The
    kernels sum in other orders than the PyTorch references: tokens agree at every decided step (``greedy.py``); the
    fractions agree but for DIPR decisions within rounding of their threshold, which may flip
    (``tests/numerics.py``, rule 2): a logit moves by ~1e-5 at most, and with logits spread over several units a
    flip touches well under 1e-3 of the decisions, the tolerance on token_fraction."""
    prompts = [PROMPT, LONG_PROMPT[:900]]
    flags = {**OWN_KERNELS, "beta": 2.0}
    results = {}
    for kernels in (False, True):
        own_kernels_llm.collective_rpc(_configure(flags, kernels))
        own_kernels_llm.reset_prefix_cache()
        results[kernels] = (greedy(own_kernels_llm, prompts, max_tokens=6), _figures(own_kernels_llm))
    (outputs, prompt_lens), rows = results[True]
    (references, reference_lens), _ = results[False]
    assert min(prompt_lens) > 200 and prompt_lens == reference_lens
    for i, (reference, ours) in enumerate(zip(references, outputs)):
        assert_decided(reference, f"prompt {i}")  # so the two generate the same queries, which the fractions count
        assert assert_same_greedy_path(reference, ours, f"prompt {i}") == 6
    assert [r["layer"] for r in rows] == [0, 1]
    for ours, theirs in zip(rows, results[False][1]):
        assert ours["block_fraction"] == pytest.approx(theirs["block_fraction"])
        assert ours["token_fraction"] == pytest.approx(theirs["token_fraction"], abs=1e-3)
