"""The vLLM sparse backend's layout of a layer's memory (``kvreuse.vllm.sparse.backend``): vLLM pads each KV page
by the rows of the block's key sketch (``customize_spec``, so that the budget counts it), and the backend reads the
layer's pages as every block's K/V packed, then every block's sketch codes, then their scales (``layer_cache``).

Shapes: 2 KV heads x head_dim 64, 32-token blocks, fp32: a page is 32 x 2 x 128 x 4 = 32 KiB, a token row 1 KiB,
a block's sketch 32 x 2 x (64 + 4) = 4,352 bytes, so 5 rows.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvreuse.errors import ConfigError
from kvreuse.kernels.key_sketch import TOKEN_ROW, sketch_reference, sketch_strides
from kvreuse.sparse.config import SparseConfig
from kvreuse.sparse.paged import SparseAttention
from kvreuse.vllm.sparse.backend import SparseAttentionBackend, layer_cache, plain_kv, sketch_bytes, sketch_rows

BLOCK, KV_HEADS, DIM, BLOCKS = 32, 2, 64, 5
PAGE = BLOCK * KV_HEADS * 2 * DIM * 4
ROW = KV_HEADS * 2 * DIM * 4
SKETCH_ROWS = 5
KV_SPAN = BLOCK * KV_HEADS * 2 * DIM  # elements of a block's K and V
CODES = BLOCK * KV_HEADS * DIM  # bytes of a block's codes


def spec(dtype=torch.float32, **fields) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=DIM, dtype=dtype, **fields)


def vllm_layer_view(layout: str, pad_rows: int = SKETCH_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's memory as vLLM allocates it (``BLOCKS`` pages padded by ``pad_rows`` token rows) and vLLM's
    ``[blocks, heads, tokens, K|V]`` view of it in ``layout`` (LBNHC or CPU_ATTN's LBHNC): blocks a page apart."""
    row = KV_HEADS * 2 * DIM
    page = (BLOCK + pad_rows) * row
    buffer = torch.zeros(BLOCKS * page)
    strides = (2 * DIM, row) if layout == "LBNHC" else (BLOCK * 2 * DIM, 2 * DIM)
    return buffer, buffer.as_strided((BLOCKS, KV_HEADS, BLOCK, 2 * DIM), (page, *strides, 1))


def byte_addresses(view: torch.Tensor) -> torch.Tensor:
    """Every byte of the storage ``view`` covers, one entry per (element, byte): repeated bytes show overlaps."""
    size = view.element_size()
    elements = torch.arange(view.untyped_storage().nbytes() // size)
    index = elements.as_strided(view.shape, view.stride(), view.storage_offset()).reshape(-1)
    return (index[:, None] * size + torch.arange(size)).reshape(-1)


def test_customize_spec_pads_each_page_by_the_rows_of_its_sketch():
    assert sketch_rows(spec()) == SKETCH_ROWS and sketch_rows(spec(torch.bfloat16)) == 9
    custom = SparseAttentionBackend.customize_spec(spec())
    assert spec().page_size_bytes == PAGE
    assert custom.page_size_bytes == PAGE + SKETCH_ROWS * ROW
    assert SparseAttentionBackend.customize_spec(custom) == custom  # asked again, nothing changes


@pytest.mark.parametrize("block_size", [16, 24, 32, 48])
def test_the_page_padding_holds_a_blocks_sketch_in_either_devices_layout(block_size):
    """``sketch_bytes`` sizes the padding from the CPU layout, whose rows of whole ``TOKEN_ROW``s of tokens make it
    the larger: at a block size that is not a multiple of that it pads more than the tokens' codes and scales."""
    sizes = {device: sketch_strides(block_size, KV_HEADS, DIM, device).block_bytes for device in ("cpu", "cuda")}
    assert sketch_bytes(block_size, KV_HEADS, DIM) == max(sizes.values()) == sizes["cpu"]
    assert sizes["cuda"] == block_size * KV_HEADS * (DIM + 4)  # token by token, nothing padded
    assert (sizes["cpu"] == sizes["cuda"]) == (block_size % TOKEN_ROW == 0)


def test_customize_spec_keeps_a_larger_padding_and_refuses_a_smaller_one():
    larger = PAGE + 8 * ROW
    assert SparseAttentionBackend.customize_spec(spec(page_size_padded=larger)).page_size_bytes == larger
    with pytest.raises(ConfigError, match=f"needs {PAGE + SKETCH_ROWS * ROW} bytes .* padded the page to {PAGE + 8}"):
        SparseAttentionBackend.customize_spec(spec(page_size_padded=PAGE + 8))


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_the_views_tile_the_layers_pages_kv_then_codes_then_scales_without_overlap(layout):
    buffer, view = vllm_layer_view(layout)
    cache = layer_cache(view)
    keys, values = byte_addresses(cache.key_cache), byte_addresses(cache.value_cache)
    codes, scales = byte_addresses(cache.sketch.codes), byte_addresses(cache.sketch.scales)
    kv_bytes = BLOCKS * KV_SPAN * 4
    # K and V: exactly the first BLOCKS * kv_span elements, each byte once
    assert torch.equal(torch.cat([keys, values]).sort().values, torch.arange(kv_bytes))
    # then every block's codes, then every block's scales: one stretch each, nothing past the layer's pages
    assert torch.equal(codes.sort().values, torch.arange(kv_bytes, kv_bytes + BLOCKS * CODES))
    end = kv_bytes + BLOCKS * CODES + BLOCKS * BLOCK * KV_HEADS * 4
    assert torch.equal(scales.sort().values, torch.arange(kv_bytes + BLOCKS * CODES, end))
    assert end <= buffer.numel() * 4 == BLOCKS * (PAGE + SKETCH_ROWS * ROW)
    # block b's sketch is one stretch, KV head by KV head, channel by channel with a channel's tokens side by side:
    # the order the CPU scan walks it (a CPU's layout, kvreuse.kernels.key_sketch.sketch_strides)
    for b in range(BLOCKS):
        block = byte_addresses(cache.sketch.codes[b].permute(1, 2, 0))  # [heads, head_dim, tokens]
        assert torch.equal(block, torch.arange(kv_bytes + b * CODES, kv_bytes + (b + 1) * CODES))
        first = kv_bytes + BLOCKS * CODES + b * BLOCK * KV_HEADS * 4
        assert torch.equal(byte_addresses(cache.sketch.scales[b].T), torch.arange(first, first + BLOCK * KV_HEADS * 4))
    assert cache.tiles == (layout == "LBHNC")


def test_a_write_puts_each_key_and_its_sketch_where_the_views_read_them():
    buffer, view = vllm_layer_view("LBNHC")
    cache = layer_cache(view)
    attention = SparseAttention(2 * KV_HEADS, KV_HEADS, DIM, BLOCK, DIM**-0.5, SparseConfig())
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(BLOCKS * BLOCK, generator=g)[:100]
    k, v = torch.randn(2, 100, KV_HEADS, DIM, generator=g)
    attention.write(k, v, cache.key_cache, cache.value_cache, cache.sketch, slots)
    blocks, offsets = slots // BLOCK, slots % BLOCK
    keys, values = plain_kv(view)  # what the module cache reads (CPU_ATTN's tiles: test_sparse_cpu_kernel.py)
    assert torch.equal(keys[blocks, offsets], k) and torch.equal(values[blocks, offsets], v)
    codes, scales = sketch_reference(k)
    assert torch.equal(cache.sketch.codes[blocks, offsets], codes)
    assert torch.equal(cache.sketch.scales[blocks, offsets], scales)


@pytest.mark.parametrize("pad_rows", [1, SKETCH_ROWS + 1], ids=["no room", "pages of another size"])
def test_layer_cache_refuses_pages_other_than_the_backends(pad_rows):
    _, view = vllm_layer_view("LBNHC", pad_rows=pad_rows)
    with pytest.raises(ConfigError, match="not laid out in pages of the backend's size"):
        layer_cache(view)
