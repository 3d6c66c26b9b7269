"""DIPR as a filter in front of a GPU engine's FlashAttention (``kvreuse.sparse.filtered_decode``): the sketch scan's
read mask, the (sequence, KV head) block tables over a one-head cache view, the persistent buffers, and the
attention the kernel then computes. On CPU tensors the scan runs in Triton's interpreter (conftest.py) and the
kernel is ``paged_attention_reference``, which is itself checked against dense attention here; on a GPU with vLLM's
FlashAttention the same tests run the real kernel (the ``flash`` cases, skipped where it cannot run).

Shapes as ``test_sparse_kernels.py``: block size 16, head_dim 64, 4 query heads on 2 KV heads, sequences of 1, 37
and 150 tokens scattered over a shuffled block pool.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from numerics import DEVICE, assert_close_to_exact, settled_dipr_selection
from test_sparse_kernels import BLOCK, DIM, KV_HEADS, LENS, LOCAL, Q_HEADS, SINK, paged

from kvreuse.kernels.block_filter import DIPRBlockFilter
from kvreuse.kernels.dipr_decode import dense_decode_reference, dipr_selection_reference, masked_decode_reference
from kvreuse.sparse.filtered_decode import FilteredDecode, paged_attention_reference
from kvreuse.sparse.pruned import one_head_view, prune_block_table

SCALE = DIM**-0.5
MAX_SEQS, MAX_BLOCKS = 8, 16


def flash_attention():
    """vLLM's FlashAttention through kvreuse's boundary, or None where it cannot run (no GPU, or no CUDA vLLM)."""
    if not torch.cuda.is_available():
        return None
    try:
        import vllm.vllm_flash_attn  # noqa: F401

        from kvreuse.patches import vllm_0_32
    except ImportError:
        return None
    return vllm_0_32.flash_attention


KERNELS = [
    pytest.param(lambda: paged_attention_reference, id="reference"),
    pytest.param(
        flash_attention,
        id="flash",
        marks=pytest.mark.skipif(
            flash_attention() is None, reason="vLLM's FlashAttention needs a GPU and vLLM's CUDA build"
        ),
    ),
]


def read_of(selection, n_seqs: int, width: int) -> torch.Tensor:
    read = torch.zeros(n_seqs, KV_HEADS, width, dtype=torch.bool, device=DEVICE)
    for i, blocks in enumerate(selection.blocks_read):
        read[i, :, : blocks.shape[1]] = blocks
    return read


def block_filter(block: int = BLOCK) -> DIPRBlockFilter:
    return DIPRBlockFilter(
        Q_HEADS, KV_HEADS, DIM, block, scale=SCALE, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, device=DEVICE
    )


# -------------------------------------------------------------------------------------------------- the read mask


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("beta", [0.5, 2.0, 4.0, float("inf")])
def test_the_scan_reads_exactly_the_blocks_of_the_reference(peaked, beta):
    query, keys, _, sketch, table, seq_lens = paged(LENS, torch.float32, peaked=peaked, seed=2)
    read = block_filter().run(query, sketch, seq_lens, table, beta, SINK, LOCAL, KV_HEADS).read
    selection = settled_dipr_selection(query, keys, sketch, table, seq_lens, beta, SCALE, SINK, LOCAL)
    assert torch.equal(read, read_of(selection, len(LENS), table.shape[1]))


@pytest.mark.parametrize("beta", [0.5, 2.0])
def test_a_group_of_three_query_heads_per_kv_head_reads_the_blocks_of_the_reference(beta):
    # SmolLM2's shape: 3 query heads per KV head, so the kernels' tile of the group has a padding row
    query, keys, _, sketch, table, seq_lens = paged(LENS, torch.float32, peaked=True, seed=2)
    pairs = query.view(len(LENS), KV_HEADS, 2, DIM)  # each KV head's two planted queries, and a third between them
    query = torch.cat([pairs, pairs.mean(2, keepdim=True)], dim=2).view(len(LENS), 3 * KV_HEADS, DIM)
    scan = DIPRBlockFilter(
        3 * KV_HEADS, KV_HEADS, DIM, BLOCK, scale=SCALE, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, device=DEVICE
    )
    read = scan.run(query, sketch, seq_lens, table, beta, SINK, LOCAL, KV_HEADS).read
    selection = settled_dipr_selection(query, keys, sketch, table, seq_lens, beta, SCALE, SINK, LOCAL)
    assert torch.equal(read, read_of(selection, len(LENS), table.shape[1]))
    assert not bool(read[2, :, : -(-LENS[2] // BLOCK)].all())  # something pruned: a padding row reading all would show


@pytest.mark.parametrize(("peaked", "beta"), [(False, 0.25), (False, 0.5), (True, 2.0), (True, 4.0)])
def test_every_block_holding_a_key_within_beta_of_the_largest_is_read(peaked, beta):
    query, keys, _, sketch, table, seq_lens = paged(LENS, torch.float16, peaked=peaked, seed=4)
    read = block_filter().run(query, sketch, seq_lens, table, beta, SINK, LOCAL, KV_HEADS).read
    selection = settled_dipr_selection(query, keys, sketch, table, seq_lens, beta, SCALE, SINK, LOCAL)
    pruned_any = False
    for i, exact in enumerate(selection.exact):  # [q_heads, seq_len]: the tokens within beta of the largest
        n_blocks = -(-LENS[i] // BLOCK)
        needed = torch.zeros(Q_HEADS, n_blocks, dtype=torch.bool, device=DEVICE)
        needed[:, torch.arange(LENS[i], device=DEVICE) // BLOCK] |= exact
        needed = needed.view(KV_HEADS, Q_HEADS // KV_HEADS, n_blocks).any(1)
        assert not (needed & ~read[i, :, :n_blocks]).any(), i
        pruned_any |= bool((~read[i, :, :n_blocks]).any())
    assert pruned_any  # the planted keys leave blocks to prune: the check above had something to catch


def test_the_mask_is_false_past_each_sequence_and_ignores_stale_bounds_of_a_longer_batch():
    query, _, _, sketch, table, seq_lens = paged(LENS, torch.float32, peaked=True)
    scan = block_filter()
    scan.run(query, sketch, seq_lens, table, 0.5, SINK, LOCAL, KV_HEADS)  # fills the bounds and mask of 10 blocks
    short = torch.tensor([20, 20, 20], dtype=torch.int32, device=DEVICE)
    read = scan.run(query, sketch, short, table, 0.5, SINK, LOCAL, KV_HEADS).read
    assert read[:, :, 2:].sum() == 0 and read[:, :, :2].all()  # 2 blocks, both in the window


# ------------------------------------------------------------------------------------------------------ the tables


@pytest.mark.parametrize("beta", [0.25, float("inf")])
def test_the_tables_list_each_sequence_and_kv_heads_read_blocks_in_order_as_blocks_of_the_one_head_view(beta):
    query, keys, _, sketch, table, seq_lens = paged(LENS, torch.float32, seed=3)
    view, per_block = one_head_view(keys)
    tables = block_filter().run(query, sketch, seq_lens, table, beta, SINK, LOCAL, per_block)
    read = tables.read.cpu()
    assert torch.equal(tables.query_start_loc.cpu(), torch.arange(len(LENS) * KV_HEADS + 1, dtype=torch.int32))
    pruned = prune_block_table(read, table.cpu(), seq_lens.cpu(), BLOCK)  # the PyTorch construction
    mixed = False
    for i, n in enumerate(LENS):
        n_blocks = -(-n // BLOCK)
        for h in range(KV_HEADS):
            row = i * KV_HEADS + h
            blocks = [int(table[i, j]) for j in range(n_blocks) if read[i, h, j]]  # row by row
            length = len(blocks) * BLOCK - (n_blocks * BLOCK - n) * bool(read[i, h, n_blocks - 1])
            assert int(tables.kept[row]) == len(blocks) == int(pruned.kept[h, i]), (i, h)
            assert int(tables.seq_lens[row]) == length == int(pruned.seq_lens[h, i]), (i, h)
            assert tables.block_table[row, : len(blocks)].tolist() == [b * per_block + h for b in blocks], (i, h)
            for j, b in enumerate(blocks):  # the view's block is KV head h of block b
                assert torch.equal(view[tables.block_table[row, j], :, 0], keys[b, :, h]), (i, h, j)
            mixed |= 0 < len(blocks) < n_blocks
    assert mixed == (beta < float("inf"))  # a finite beta prunes some rows' blocks, not all: the lists are tested


@pytest.mark.parametrize("rows", [BLOCK, BLOCK + 5], ids=["packed", "padded"])
def test_the_one_head_view_addresses_vllms_gpu_layout(rows):
    # An LBNHC cache [blocks, block_size, kv_heads, K|V] split into key and value caches as the backend's
    # layer_cache does: its blocks packed (``rows`` = block_size, the backend's layout) or a page of 5 more rows apart.
    blocks = 6
    pages = torch.randn(blocks, rows, KV_HEADS, 2 * DIM)
    key_cache, value_cache = pages[:, :BLOCK].split(DIM, dim=-1)
    for cache, half in ((key_cache, slice(0, DIM)), (value_cache, slice(DIM, 2 * DIM))):
        view, per_block = one_head_view(cache)
        assert per_block == rows * KV_HEADS and view.stride() == (2 * DIM, KV_HEADS * 2 * DIM, DIM, 1)
        for b in range(blocks):
            for h in range(KV_HEADS):
                assert torch.equal(view[b * per_block + h, :, 0], pages[b, :BLOCK, h, half])


# ------------------------------------------------------------------------------------------- the kernel behind it


def test_the_reference_kernel_is_causal_paged_attention():
    query, keys, values, _, table, seq_lens = paged(LENS, torch.float32, seed=6)
    out = torch.empty_like(query)
    starts = torch.arange(len(LENS) + 1, dtype=torch.int32, device=DEVICE)
    paged_attention_reference(query, keys, values, out, starts, seq_lens, 1, max(LENS), table, SCALE)
    expected = dense_decode_reference(query.double(), keys.double(), values.double(), table, seq_lens, SCALE)
    assert torch.allclose(out.double(), expected, atol=1e-5)
    # two query tokens at the end of a 37-token sequence: the first sees 36 keys, the second all 37
    two = torch.empty(2, Q_HEADS, DIM, device=DEVICE)
    paged_attention_reference(query[:2], keys, values, two, starts[[0, 2]], seq_lens[1:2], 2, 37, table[1:2], SCALE)
    shorter = dense_decode_reference(
        query[:1].double(), keys.double(), values.double(), table[1:2], seq_lens[1:2] - 1, SCALE
    )
    assert torch.allclose(two[0].double(), shorter[0], atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("beta", [0.5, 4.0, float("inf")])
def test_filtered_decode_attends_every_token_of_the_blocks_read_and_nothing_else(kernel, beta):
    dtype = torch.float16 if DEVICE.type == "cuda" else torch.float32
    query, keys, values, sketch, table, seq_lens = paged(LENS, dtype, peaked=True, seed=8)
    decode = FilteredDecode(
        Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, kernel=kernel()
    )
    out = torch.empty_like(query)
    counts = decode.run(query, keys, values, sketch, seq_lens, table, max(LENS), beta, SINK, LOCAL, out)
    selection = settled_dipr_selection(query, keys, sketch, table, seq_lens, beta, SCALE, SINK, LOCAL)
    group = Q_HEADS // KV_HEADS
    masks = [
        blocks.repeat_interleave(group, 0)[:, torch.arange(n, device=DEVICE) // BLOCK]
        for blocks, n in zip(selection.blocks_read, LENS)
    ]
    exact, magnitude = (masked_decode_reference(v, table, seq_lens, selection.logits, masks) for v in
                        (values.double(), values.double().abs()))  # fmt: skip
    logits = dipr_selection_reference(query, keys, sketch, table, seq_lens, beta, SCALE, SINK, LOCAL).logits
    fp32 = masked_decode_reference(values, table, seq_lens, logits, masks)
    assert_close_to_exact(out, [fp32], exact, magnitude=magnitude, what="filtered decode")
    read = torch.stack([m.view(KV_HEADS, group, -1)[:, 0].sum(-1) for m in masks])  # tokens per (sequence, KV head)
    assert torch.equal(counts.tokens_attended.long().cpu(), read.cpu())
    assert torch.equal(counts.blocks_read.cpu(), read_of(selection, len(LENS), table.shape[1]).sum(-1).cpu())


def test_a_step_reuses_the_buffers_it_hands_the_kernel():
    seen: list[tuple[int, ...]] = []

    def recording(query, key_cache, value_cache, out, cu_seqlens_q, seqused_k, max_q, max_k, block_table, scale):
        seen.append((cu_seqlens_q.data_ptr(), seqused_k.data_ptr(), block_table.data_ptr()))
        paged_attention_reference(query, key_cache, value_cache, out, cu_seqlens_q, seqused_k, max_q, max_k,
                                  block_table, scale)  # fmt: skip

    query, keys, values, sketch, table, seq_lens = paged(LENS, torch.float32, peaked=True)
    decode = FilteredDecode(
        Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, kernel=recording
    )
    for step in range(3):  # batches of 3, 2 and 3 decodes, as an engine's steps
        n = 2 if step == 1 else 3
        out = torch.empty_like(query[:n])
        decode.run(query[:n], keys, values, sketch, seq_lens[:n], table[:n], 150, 2.0, SINK, LOCAL, out)
    assert len(seen) == 3 and len(set(seen)) == 1
    first_filter = decode.filter
    decode.run(query, keys, values, sketch, seq_lens, table, 150, 2.0, SINK, LOCAL, torch.empty_like(query))
    assert decode.filter is first_filter


def test_an_engine_table_wider_than_the_buffers_is_read_up_to_the_steps_longest_sequence():
    query, keys, values, sketch, table, seq_lens = paged(LENS, torch.float32, peaked=True)
    wide = torch.cat([table, torch.zeros(len(LENS), 40, dtype=torch.int32, device=DEVICE)], dim=1)  # 52 columns
    narrow_out, wide_out = torch.empty_like(query), torch.empty_like(query)
    for t, out in ((table, narrow_out), (wide, wide_out)):
        decode = FilteredDecode(
            Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, max_seqs=MAX_SEQS, max_blocks=10, kernel=paged_attention_reference
        )
        decode.run(query, keys, values, sketch, seq_lens, t, max(LENS), 2.0, SINK, LOCAL, out)
    assert torch.equal(narrow_out, wide_out)


def test_a_batch_larger_than_the_buffers_is_refused_naming_the_limit():
    query, keys, values, sketch, table, seq_lens = paged(LENS, torch.float32)
    decode = FilteredDecode(
        Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, max_seqs=2, max_blocks=MAX_BLOCKS, kernel=paged_attention_reference
    )
    with pytest.raises(ValueError, match="made for 1 to 2"):
        decode.run(query, keys, values, sketch, seq_lens, table, 150, 2.0, SINK, LOCAL, torch.empty_like(query))


# ---------------------------------------------------------------------------------------- in the sparse backend


def test_the_backend_runs_dense_steps_as_one_kernel_call_and_dipr_decodes_through_the_filter():
    """``SparseAttention`` with a ``decode_kernel`` (vLLM's FlashAttention on a GPU engine), on the backend's
    stand-in engine (``test_sparse_backend_pieces.Engine``): the prefill is one call over the whole batch, as the
    stock backend makes it; a step with a DIPR decode (request 0, past ``min_context``) and a dense one (request 1)
    runs the dense one on the Triton path and the DIPR one as one call over its KV heads' rows of the one-head view,
    attending every token of the blocks the scan keeps; at beta = inf the decode step is one call again."""
    from test_sparse_backend_pieces import Engine, sparse

    from kvreuse.sparse.paged import SparseAttention

    calls: list[tuple[int, int, int]] = []

    def recording(query, key_cache, value_cache, out, cu_seqlens_q, seqused_k, max_q, max_k, block_table, scale):
        calls.append((len(cu_seqlens_q) - 1, max_q, key_cache.shape[2]))
        paged_attention_reference(query, key_cache, value_cache, out, cu_seqlens_q, seqused_k, max_q, max_k,
                                  block_table, scale)  # fmt: skip

    config = sparse(4.0, sink=4, local=8, min_context=100)
    engine = Engine(config, peaked=True, kernels=True, device=DEVICE)
    engine.attention = SparseAttention(
        Q_HEADS, KV_HEADS, DIM, 32, SCALE, config, kernels=True, decode_kernel=recording, max_seqs=4, max_context=512
    )
    query, _, _, batch = engine.step([300, 45])
    out = engine.attend(1, query, batch)
    assert calls == [(2, 300, KV_HEADS)]
    keys, values = engine.key_cache.double(), engine.value_cache.double()
    last = batch.query_start_loc_cpu[1:].long() - 1  # each request's last prompt token sees its whole prompt
    whole = dense_decode_reference(query[last].double(), keys, values, batch.block_table, batch.seq_lens, SCALE)
    assert torch.allclose(out[last].double(), whole, atol=1e-5)

    calls.clear()
    query, _, _, batch = engine.step([1, 1])
    out = engine.attend(1, query, batch)
    assert calls == [(KV_HEADS, 1, 1)]  # request 0's two KV heads, each its own row of the one-head view
    selection = settled_dipr_selection(
        query[:1], engine.key_cache, engine.sketch, batch.block_table[:1], batch.seq_lens[:1], 4.0, SCALE, 4, 8
    )
    n = int(batch.seq_lens_cpu[0])
    mask = selection.blocks_read[0].repeat_interleave(Q_HEADS // KV_HEADS, 0)[:, torch.arange(n, device=DEVICE) // 32]
    filtered = masked_decode_reference(values, batch.block_table[:1], batch.seq_lens[:1], selection.logits, [mask])
    assert torch.allclose(out[:1].double(), filtered, atol=1e-5)
    dense = dense_decode_reference(query[1:].double(), keys, values, batch.block_table[1:], batch.seq_lens[1:], SCALE)
    assert torch.allclose(out[1:].double(), dense, atol=1e-5)
    assert engine.attention.figures.rows()[0]["block_fraction"] < 0.8

    calls.clear()
    engine.attention.configure(sparse(float("inf"), sink=4, local=8, min_context=100))
    query, _, _, batch = engine.step([1, 1])
    engine.attend(1, query, batch)
    assert calls == [(2, 1, KV_HEADS)]


def written_by_the_tables(query, key_cache, value_cache, out, cu_seqlens_q, seqused_k, *rest) -> None:
    """A capturable stand-in for FlashAttention where it does not run: it writes every row of ``out`` from the
    row's query and the pruned length the filter's tables give it (the same arguments, no host read), so a graph
    replay that passed stale tables or queries writes something else."""
    out.copy_(query * seqused_k.view(-1, 1, 1).to(query.dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_filter_and_its_tables_replay_from_a_cuda_graph_with_new_queries():
    """The path a GPU engine captures in its decode graphs: the scan, the mask and the tables, then FlashAttention
    (or, without it, a stand-in that writes every output row from the tables), replayed on new queries, give what an
    eager run gives."""
    query, keys, values, sketch, table, seq_lens = paged(LENS, torch.float16, peaked=True, seed=8)
    kernel = flash_attention() or written_by_the_tables
    decode = FilteredDecode(
        Q_HEADS, KV_HEADS, DIM, BLOCK, SCALE, max_seqs=MAX_SEQS, max_blocks=MAX_BLOCKS, kernel=kernel
    )
    step_query, out = query.clone(), torch.empty_like(query)
    run = partial(decode.run, step_query, keys, values, sketch, seq_lens, table, max(LENS), 2.0, SINK, LOCAL, out)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiles the scan and makes the buffers, off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        counts = run()
    for seed in (1, 2):
        step_query.copy_(torch.randn(query.shape, generator=torch.Generator().manual_seed(seed)).to(query))
        graph.replay()
        assert decode.filter is not None
        replayed = (decode.filter.block_table.clone(), counts.blocks_read.clone(), out.clone())
        eager = run()
        assert torch.equal(replayed[0], decode.filter.block_table) and torch.equal(replayed[1], eager.blocks_read)
        assert torch.equal(replayed[2], out)
