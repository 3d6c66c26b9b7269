"""The vLLM sparse backend keeps block bounds in one padding row of each KV page (``kvreuse.vllm.attention``).

Shapes: 2 KV heads x head_dim 64, 32-token blocks, fp32: a page is 32 x 2 x 128 x 4 = 32 KiB, its bounds row 1 KiB.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvreuse.errors import ConfigError
from kvreuse.vllm.attention import SparseAttentionBackend, page_bounds

BLOCK, KV_HEADS, DIM, BLOCKS = 32, 2, 64, 5
PAGE = BLOCK * KV_HEADS * 2 * DIM * 4
ROW = KV_HEADS * 2 * DIM * 4


def spec(**fields) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=DIM, dtype=torch.float32, **fields)


def padded_layer_view(pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat buffer and vLLM's ``[blocks, heads, tokens, K|V]`` LBNHC view of it, pages padded by ``pad_rows``."""
    row = KV_HEADS * 2 * DIM
    buffer = torch.zeros(BLOCKS * (BLOCK + pad_rows) * row)
    view = buffer.as_strided((BLOCKS, KV_HEADS, BLOCK, 2 * DIM), ((BLOCK + pad_rows) * row, 2 * DIM, row, 1))
    return buffer, view


def test_customize_spec_pads_each_page_by_exactly_one_bounds_row():
    custom = SparseAttentionBackend.customize_spec(spec())
    assert spec().page_size_bytes == PAGE
    assert custom.page_size_bytes == PAGE + ROW
    assert SparseAttentionBackend.customize_spec(custom) == custom  # asked again, nothing changes


def test_customize_spec_keeps_a_larger_padding_and_refuses_a_smaller_one():
    assert (
        SparseAttentionBackend.customize_spec(spec(page_size_padded=PAGE + 4 * ROW)).page_size_bytes == PAGE + 4 * ROW
    )
    with pytest.raises(ConfigError, match=f"needs {PAGE + ROW} bytes per KV page .* padded the page to {PAGE + 8}"):
        SparseAttentionBackend.customize_spec(spec(page_size_padded=PAGE + 8))


def test_page_bounds_are_the_padding_row_max_in_the_k_half_min_in_the_v_half():
    buffer, view = padded_layer_view()
    bounds = page_bounds(view, DIM)
    assert tuple(bounds.shape) == (BLOCKS, KV_HEADS, 2, DIM)
    bounds[3, 1, 0] = 7.0  # block 3, KV head 1, maxima
    bounds[3, 1, 1] = -7.0  # minima
    row = buffer.view(BLOCKS, BLOCK + 1, KV_HEADS, 2 * DIM)[3, BLOCK, 1]
    assert (row[:DIM] == 7.0).all() and (row[DIM:] == -7.0).all()
    assert (view == 0).all()  # no token of any page was touched
    assert int((buffer != 0).sum()) == 2 * DIM


def test_page_bounds_refuses_a_page_without_a_padding_row():
    _, view = padded_layer_view(pad_rows=0)
    with pytest.raises(ConfigError, match="has no such row"):
        page_bounds(view, DIM)
