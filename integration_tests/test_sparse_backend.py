"""The sparse attention backend in the real CPU engine (``KVREUSE_SPARSE_CPU_BACKEND=1``), on the small model.

Two engines: the stock one (CPU_ATTN) answers first and is stopped, then one with the sparse backend, DIPR in every
layer (``dense_layers = 0``, ``min_context = 0``), which is reconfigured between tests through ``collective_rpc``
(``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` lets it send a function).
"""

from __future__ import annotations

import os

import pytest

from real_engine import start_llm, stop_llm

pytestmark = pytest.mark.engine

WORDS = ("movie", "review", "the", "plot", "was", "slow", "but", "actors", "shine", "in", "every", "scene")
PROMPTS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] + str(j % (5 + i)) for j in range(n))
           for i, n in enumerate((60, 250, 600))]
LONG_PROMPT = " ".join(f"{WORDS[j % len(WORDS)]}{j}" for j in range(600))  # ~1,600 tokens
MAX_TOKENS = 12
EXACT = {"beta": float("inf"), "min_context": 0, "dense_layers": 0}


def greedy_tokens(llm, prompts, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [len(o.prompt_token_ids) for o in outs]


def _configure(flags):
    """A function for ``collective_rpc``: new sparse settings and empty figures in the worker."""
    def call(worker):
        from kvreuse.vllm import attention

        attention.configure_sparse(flags)
        attention.reset_sparse_figures()

    return call


def _figures(llm):
    """The worker's attended fractions per layer (a closure, so it is sent by value, not by module name)."""
    def call(worker):
        from kvreuse.vllm.attention import sparse_figures

        return sparse_figures()

    return llm.collective_rpc(call)[0]


@pytest.fixture(scope="module")
def stock_tokens(small_model):
    llm = start_llm(small_model)
    try:
        return greedy_tokens(llm, PROMPTS)
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def sparse_llm(small_model, stock_tokens):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = start_llm(small_model, additional_config={"kvreuse": {"sparse": EXACT}})
        try:
            yield llm
        finally:
            stop_llm(llm)
            if not overridden:  # in-process engines of later modules must get the stock CPU_ATTN again
                AttentionBackendEnum.CPU_ATTN.clear_override()


def test_registration_names_the_backend_custom_and_leaves_cpu_attn_alone_without_the_switch():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvreuse.vllm.registration import SPARSE_BACKEND, _register_sparse_backend

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    env = os.environ.pop("KVREUSE_SPARSE_CPU_BACKEND", None)
    try:
        _register_sparse_backend()
        assert AttentionBackendEnum.CUSTOM.get_path() == SPARSE_BACKEND
        assert AttentionBackendEnum.CPU_ATTN.is_overridden() == overridden
    finally:
        if env is not None:
            os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = env


def test_beta_inf_in_every_layer_gives_the_stock_engines_greedy_tokens(sparse_llm, stock_tokens):
    sparse_llm.collective_rpc(_configure(EXACT))
    tokens, prompt_lens = greedy_tokens(sparse_llm, PROMPTS)
    assert min(prompt_lens) > 100
    assert tokens == stock_tokens[0]
    rows = _figures(sparse_llm)
    assert [r["layer"] for r in rows] == [0, 1]
    assert all(r["block_fraction"] == 1.0 and r["token_fraction"] == 1.0 for r in rows)


def test_finite_beta_runs_and_reports_what_each_layer_attended(sparse_llm):
    sparse_llm.collective_rpc(_configure({**EXACT, "beta": 2.0, "sample_recovery": 4}))
    tokens, prompt_lens = greedy_tokens(sparse_llm, [LONG_PROMPT], max_tokens=8)
    assert prompt_lens[0] > 1400 and len(tokens[0]) == 8
    rows = _figures(sparse_llm)
    assert [r["layer"] for r in rows] == [0, 1]
    for row in rows:
        # Random weights give keys without structure: per-block bounds exclude no block (1.000 of blocks read, both
        # layers); DIPR attends ~0.22-0.24 of the tokens and keeps ~0.71 of the dense attention mass at beta = 2.
        assert 0.0 < row["block_fraction"] <= 1.0
        assert 0.0 < row["token_fraction"] < 0.5
        assert row["samples"] > 0 and 0.0 < row["recovery_min"] <= row["recovery_mean"] <= 1.0
