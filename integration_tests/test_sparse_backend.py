"""The sparse attention backend in the real CPU engine (``KVREUSE_SPARSE_CPU_BACKEND=1``), on the small model.

Two engines: the stock one (CPU_ATTN) answers first and is stopped, then one with the sparse backend, DIPR in every
layer (``dense_layers = 0``, ``min_context = 0``), which is reconfigured between tests through ``collective_rpc``
(``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` lets it send a function). The backend runs as it does by default on vLLM's
CPU build: CPU_ATTN's KV layout and vLLM's own attention ops, DIPR choosing the blocks each KV head reads
(``sparse.engine_kernel``); ``test_sparse_backend_own_kernels.py`` runs kvreuse's own kernels on the plain layout.
The engine also runs the figures' connector ``KVReuseSparseFigures``, which takes the figures into vLLM's metrics
and must change no answer.
"""

from __future__ import annotations

import os

import pytest
from greedy import LOGPROBS, assert_same_greedy_path
from real_engine import start_llm, stop_llm

pytestmark = pytest.mark.engine

WORDS = ("movie", "review", "the", "plot", "was", "slow", "but", "actors", "shine", "in", "every", "scene")
PROMPTS = [
    " ".join(WORDS[(i * 7 + j) % len(WORDS)] + str(j % (5 + i)) for j in range(n)) for i, n in enumerate((60, 250, 600))
]
LONG_PROMPT = " ".join(f"{WORDS[j % len(WORDS)]}{j}" for j in range(600))  # ~1,600 tokens
MAX_TOKENS = 12
EXACT = {"beta": float("inf"), "min_context": 0, "dense_layers": 0}
FIGURES_CONNECTOR = {"kv_connector": "KVReuseSparseFigures", "kv_role": "kv_both"}


def greedy(llm, prompts, max_tokens=MAX_TOKENS):
    """The greedy completions (with their leading log-probabilities, see ``greedy.py``) and the prompts' lengths."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], [len(o.prompt_token_ids) for o in outs]


def _configure(flags):
    """A function for ``collective_rpc``: new sparse settings and empty figures in the worker."""

    def call(worker):
        from kvreuse.vllm import runtime

        runtime.configure_sparse(flags)
        runtime.reset_sparse_figures()

    return call


def _figures(llm):
    """The worker's attended fractions per layer (a closure, so it is sent by value, not by module name)."""

    def call(worker):
        from kvreuse.vllm.runtime import sparse_figures

        return sparse_figures()

    return llm.collective_rpc(call)[0]


def _sparse_counters(llm) -> dict[tuple[str, int], float]:
    """The ``vllm:kvreuse_sparse_*`` counters as ``LLM.get_metrics()`` lists them, by name and layer."""
    prefix = "vllm:kvreuse_sparse_"
    return {
        (m.name.removeprefix(prefix), int(m.labels["layer"])): m.value
        for m in llm.get_metrics()
        if m.name.startswith(prefix)
    }


def _kv_layout(worker):
    """Layer 0's KV cache and key sketch as the worker holds them: sizes, where K/V and the sketch lie in the layer's
    memory, and whether the sketch is that of the keys stored."""
    import torch

    from kvreuse.kernels.key_sketch import sketch_reference
    from kvreuse.vllm.sparse.backend import plain_kv

    layer = next(
        module
        for module in worker.model_runner.compilation_config.static_forward_context.values()
        if getattr(module, "impl", None) is not None and getattr(module.impl, "_views", None)
    )
    kv_cache = layer.kv_cache
    key_cache, _, sketch = layer.impl._views[1]
    keys = layer.impl.attention.paged_kernel.plain_keys(key_cache)  # CPU_ATTN's packed key tiles, read in place
    written = (sketch.scales > 0).all(-1).all(-1)  # blocks whose every slot holds a sketched key
    first = int(written.nonzero()[0])
    codes, scales = sketch_reference(keys[first])
    layer_start = kv_cache.data_ptr()  # the layer's first page (vLLM keeps every layer's pages in one allocation)
    return {
        "num_blocks": kv_cache.shape[0],
        "block_stride_bytes": kv_cache.stride(0) * kv_cache.element_size(),
        "page_bytes": kv_cache[0].numel() * kv_cache.element_size(),
        "layer_start": layer_start - kv_cache.untyped_storage().data_ptr(),
        "storage_bytes": kv_cache.untyped_storage().nbytes(),
        "kv_block_stride_bytes": plain_kv(kv_cache)[0].stride(0) * kv_cache.element_size(),
        "kv_at": plain_kv(kv_cache)[0].data_ptr() - layer_start,
        "key_cache_is_kv": key_cache.data_ptr() == plain_kv(kv_cache)[0].data_ptr(),
        "codes_at": sketch.codes.data_ptr() - layer_start,
        "scales_at": sketch.scales.data_ptr() - layer_start,
        "same_memory": sketch.codes.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr(),
        "written_blocks": int(written.sum()),
        "sketch_is_the_keys_sketch": bool(torch.equal(sketch.codes[first], codes))
        and bool(torch.equal(sketch.scales[first], scales)),
    }


@pytest.fixture(scope="module")
def stock_tokens(small_model):
    llm = start_llm(small_model)
    try:
        return greedy(llm, PROMPTS)
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def sparse_llm(small_model, stock_tokens):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVREUSE_SPARSE_CPU_BACKEND", "1")
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        llm = start_llm(
            small_model, additional_config={"kvreuse": {"sparse": EXACT}}, kv_transfer_config=FIGURES_CONNECTOR
        )
        try:
            yield llm
        finally:
            stop_llm(llm)
            if not overridden:  # in-process engines of later modules must get the stock CPU_ATTN again
                AttentionBackendEnum.CPU_ATTN.clear_override()


def test_registration_names_the_backend_custom_and_leaves_cpu_attn_alone_without_the_switch():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvreuse.vllm.names import SPARSE_BACKEND
    from kvreuse.vllm.registration import _register_sparse_backend

    overridden = AttentionBackendEnum.CPU_ATTN.is_overridden()
    env = os.environ.pop("KVREUSE_SPARSE_CPU_BACKEND", None)
    try:
        _register_sparse_backend()
        assert AttentionBackendEnum.CUSTOM.get_path() == SPARSE_BACKEND
        assert AttentionBackendEnum.CPU_ATTN.is_overridden() == overridden
    finally:
        if env is not None:
            os.environ["KVREUSE_SPARSE_CPU_BACKEND"] = env


def test_a_cpu_engine_keeps_contexts_up_to_8k_dense_unless_min_context_is_set(sparse_llm):
    def min_context(flags):
        def call(worker):
            from kvreuse.vllm import runtime

            return runtime.configure_sparse(flags).min_context

        return call

    try:
        assert sparse_llm.collective_rpc(min_context({"beta": 4.0})) == [8192]
        assert sparse_llm.collective_rpc(min_context({"beta": 4.0, "min_context": 100})) == [100]
    finally:
        sparse_llm.collective_rpc(_configure(EXACT))


def test_beta_inf_in_every_layer_gives_the_stock_engines_greedy_tokens(sparse_llm, stock_tokens):
    """At beta = inf every attention is the stock kernel's call on the stock layout. Not bit for bit the stock
    engine's generations all the same: the op splits a sequence's keys over the worker's threads, and its sums
    change in the last bits with their number (measured: 2e-7 between one and two threads), so two engines agree as
    two implementations do: same tokens at every decided step (``greedy.py``)."""
    sparse_llm.collective_rpc(_configure(EXACT))
    outputs, prompt_lens = greedy(sparse_llm, PROMPTS)
    assert min(prompt_lens) > 100 and prompt_lens == stock_tokens[1]
    for i, (ours, stock) in enumerate(zip(outputs, stock_tokens[0])):
        assert_same_greedy_path(stock, ours, f"prompt {i}")
    rows = _figures(sparse_llm)
    assert [r["layer"] for r in rows] == [0, 1]
    assert all(r["block_fraction"] == 1.0 and r["token_fraction"] == 1.0 for r in rows)


def test_finite_beta_runs_and_reports_what_each_layer_attended(sparse_llm):
    sparse_llm.collective_rpc(_configure({**EXACT, "beta": 2.0, "sample_recovery": 4}))
    outputs, prompt_lens = greedy(sparse_llm, [LONG_PROMPT], max_tokens=8)
    assert prompt_lens[0] > 1400 and len(outputs[0].token_ids) == 8
    rows = _figures(sparse_llm)
    assert [r["layer"] for r in rows] == [0, 1]
    for row in rows:
        # The engine's kernel attends every token of the blocks each KV head reads: the token fraction is the block
        # fraction but for the sequences' partly filled last blocks (always read). The sampled recovery is that of
        # the Triton kernel's attended set (window and tokens at or above tau: ~0.71 of the dense mass at beta = 2
        # on random weights' keys), a lower bound on the filter's.
        assert 0.0 < row["block_fraction"] <= 1.0
        assert row["block_fraction"] - 0.05 < row["token_fraction"] <= row["block_fraction"]
        assert row["samples"] > 0 and 0.0 < row["recovery_min"] <= row["recovery_mean"] <= 1.0


def test_the_key_sketches_follow_every_blocks_kv_in_each_layers_pages_inside_the_cache_budget(sparse_llm):
    from kvreuse.localmodel import local_engine_args

    sparse_llm.collective_rpc(_configure(EXACT))
    greedy(sparse_llm, [LONG_PROMPT], max_tokens=4)
    layout = sparse_llm.collective_rpc(_kv_layout)[0]
    # Small model: 2 layers, 2 KV heads x head_dim 64, fp32, 32-token blocks: a page is 32 x 2 x 128 x 4 = 32 KiB
    # and its sketch 32 x 2 x (64 + 4) bytes = 5 token rows of 1 KiB more; 256 MiB of cache then holds 3,542 blocks
    # (4,096 without the sketch).
    page, padded, sketch_codes = 32 * 2 * 128 * 4, 37 * 2 * 128 * 4, 32 * 2 * 64
    assert layout["page_bytes"] == page and layout["block_stride_bytes"] == padded  # vLLM's view: padded pages
    budget = local_engine_args("model")["kv_cache_memory_bytes"]
    blocks = layout["num_blocks"]
    assert blocks == budget // (2 * padded) == 3542
    # the layer's pages are one stretch of vLLM's allocation (layer-major layouts: layer by layer)
    assert layout["layer_start"] % (blocks * padded) == 0
    assert layout["layer_start"] + blocks * padded <= layout["storage_bytes"]
    # the backend's: every block's K/V packed from the layer's first byte, then every block's codes, then scales,
    # all inside the layer's padded pages
    assert layout["kv_at"] == 0 and layout["kv_block_stride_bytes"] == page and layout["key_cache_is_kv"]
    assert layout["codes_at"] == blocks * page and layout["scales_at"] == blocks * (page + sketch_codes)
    assert layout["scales_at"] + blocks * 32 * 2 * 4 <= blocks * padded
    assert layout["same_memory"]
    assert layout["written_blocks"] >= 1600 // 32 and layout["sketch_is_the_keys_sketch"]


def test_the_figures_and_decode_counts_reach_llm_get_metrics_per_layer_through_the_figures_connector(sparse_llm):
    sparse_llm.collective_rpc(_configure({**EXACT, "beta": 2.0, "sample_recovery": 4}))
    before = _sparse_counters(sparse_llm)
    greedy(sparse_llm, [LONG_PROMPT], max_tokens=8)
    after = _sparse_counters(sparse_llm)
    rows = _figures(sparse_llm)
    assert {layer for _, layer in after} == {row["layer"] for row in rows} == {0, 1}

    def grown(name: str, layer: int) -> float:
        return after[(name, layer)] - before.get((name, layer), 0)

    for row in rows:
        layer = row["layer"]
        assert grown("blocks", layer) > 0 and grown("tokens", layer) > 0
        assert grown("blocks_read", layer) / grown("blocks", layer) == pytest.approx(row["block_fraction"])
        assert grown("tokens_attended", layer) / grown("tokens", layer) == pytest.approx(row["token_fraction"])
        assert grown("recovery_samples", layer) == row["samples"] > 0
        assert grown("recovery_kept_ppm", layer) / 1e6 / row["samples"] == pytest.approx(row["recovery_mean"], rel=1e-5)
        assert grown("dipr_decodes", layer) == row["dipr_decodes"] == 7  # 8 tokens: the first comes from prefill


def _poison_kv_cache(worker):
    """Fill every layer's whole KV cache, key sketches included, with NaN: what a request whose arithmetic
    overflowed leaves in the blocks it frees (issue 26), everywhere at once."""
    import torch

    for module in worker.model_runner.compilation_config.static_forward_context.values():
        kv_cache = getattr(module, "kv_cache", None)
        if isinstance(kv_cache, torch.Tensor) and kv_cache.is_floating_point():
            # the layer's whole memory, whatever the backend keeps where in it
            whole = kv_cache.untyped_storage().nbytes() // kv_cache.element_size()
            torch.empty(0, dtype=kv_cache.dtype).set_(kv_cache.untyped_storage()).view(whole).fill_(float("nan"))


@pytest.mark.parametrize("flags", [EXACT, {**EXACT, "beta": 2.0}], ids=["beta-inf", "beta-2"])
def test_nan_left_in_freed_blocks_changes_no_later_requests_answer(sparse_llm, flags):
    """The cross-tenant corruption of issue 26: a block keeps what its last request wrote, and a new request
    overwrites only the slots it fills, so the slots after its last token hold the old NaN. Every request's greedy
    tokens after the whole cache was poisoned are those it gets on a clean cache (on the code before the fix, a
    zero softmax weight times a stale NaN value made every decode NaN)."""
    sparse_llm.collective_rpc(_configure(flags))
    sparse_llm.reset_prefix_cache()
    clean, _ = greedy(sparse_llm, PROMPTS)
    sparse_llm.reset_prefix_cache()
    sparse_llm.collective_rpc(_poison_kv_cache)
    poisoned, _ = greedy(sparse_llm, PROMPTS)
    sparse_llm.collective_rpc(_configure(EXACT))
    for i, (reference, ours) in enumerate(zip(clean, poisoned)):
        assert ours.token_ids == reference.token_ids, f"prompt {i}"


def test_top_pages_calibration_measures_each_budget_against_dense_attention_and_restores_the_settings(sparse_llm):
    """``kvreuse calibrate-sparse``'s run on the engine: dense attention's tokens, exact DIPR's and each budget's,
    the blocks each read (a budget of one page per KV head reads fewer than exact DIPR; one larger than the context
    is exact DIPR), and the engine's own settings back afterwards."""
    from kvreuse.sparse.calibrate import EXACT as EXACT_DIPR
    from kvreuse.vllm.sparse.calibrate import calibrate_top_pages

    sparse_llm.collective_rpc(_configure(EXACT))
    found = calibrate_top_pages(sparse_llm, [LONG_PROMPT, PROMPTS[2]], 0.5, beta=2.0, candidates=(1, 100), max_tokens=4)
    by_budget = {m.top_pages: m for m in found.curve}
    assert set(by_budget) == {EXACT_DIPR, 1, 100} and all(m.prompts == 2 for m in found.curve)
    assert by_budget[1].blocks_read < by_budget[EXACT_DIPR].blocks_read
    assert by_budget[100].blocks_read == by_budget[EXACT_DIPR].blocks_read
    assert by_budget[100].agreed == by_budget[EXACT_DIPR].agreed
    assert found.chosen in (1, 100) and "top_pages" in found.report()

    def settings(worker):
        from kvreuse.vllm.runtime import sparse_attention

        config = sparse_attention().config
        return config.beta, config.top_pages, config.min_context, config.dense_layers

    assert sparse_llm.collective_rpc(settings) == [(float("inf"), 0, 0, 0)]
