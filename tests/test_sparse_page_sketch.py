"""The vLLM sparse backend keeps each block's key sketch in padding rows of its KV page
(``kvreuse.vllm.sparse.backend``).

Shapes: 2 KV heads x head_dim 64, 32-token blocks, fp32: a page is 32 x 2 x 128 x 4 = 32 KiB, a token row 1 KiB,
a block's sketch 32 x 2 x (64 + 4) = 4,352 bytes, so 5 rows.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvreuse.errors import ConfigError
from kvreuse.vllm.sparse.backend import SparseAttentionBackend, page_sketch, sketch_rows

BLOCK, KV_HEADS, DIM, BLOCKS = 32, 2, 64, 5
PAGE = BLOCK * KV_HEADS * 2 * DIM * 4
ROW = KV_HEADS * 2 * DIM * 4
SKETCH_ROWS = 5


def spec(dtype=torch.float32, **fields) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=DIM, dtype=dtype, **fields)


def padded_layer_view(pad_rows: int = SKETCH_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat buffer and vLLM's ``[blocks, heads, tokens, K|V]`` LBNHC view of it, pages padded by ``pad_rows``."""
    row = KV_HEADS * 2 * DIM
    buffer = torch.zeros(BLOCKS * (BLOCK + pad_rows) * row)
    view = buffer.as_strided((BLOCKS, KV_HEADS, BLOCK, 2 * DIM), ((BLOCK + pad_rows) * row, 2 * DIM, row, 1))
    return buffer, view


def test_customize_spec_pads_each_page_by_the_rows_of_its_sketch():
    assert sketch_rows(spec()) == SKETCH_ROWS and sketch_rows(spec(torch.bfloat16)) == 9
    custom = SparseAttentionBackend.customize_spec(spec())
    assert spec().page_size_bytes == PAGE
    assert custom.page_size_bytes == PAGE + SKETCH_ROWS * ROW
    assert SparseAttentionBackend.customize_spec(custom) == custom  # asked again, nothing changes


def test_customize_spec_keeps_a_larger_padding_and_refuses_a_smaller_one():
    larger = PAGE + 8 * ROW
    assert SparseAttentionBackend.customize_spec(spec(page_size_padded=larger)).page_size_bytes == larger
    with pytest.raises(ConfigError, match=f"needs {PAGE + SKETCH_ROWS * ROW} bytes .* padded the page to {PAGE + 8}"):
        SparseAttentionBackend.customize_spec(spec(page_size_padded=PAGE + 8))


def test_page_sketch_views_the_padding_rows_codes_then_scales_and_touches_no_token():
    buffer, view = padded_layer_view()
    sketch = page_sketch(view, DIM)
    assert tuple(sketch.codes.shape) == (BLOCKS, BLOCK, KV_HEADS, DIM) and sketch.codes.dtype == torch.int8
    assert tuple(sketch.scales.shape) == (BLOCKS, BLOCK, KV_HEADS) and sketch.scales.dtype == torch.float32
    sketch.codes[3, 2, 1] = 7  # block 3, token 2, KV head 1
    sketch.scales[3, 31, 1] = 0.5  # the last scale of block 3
    page = buffer.view(BLOCKS, -1)[3].view(torch.int8)
    padding = page[BLOCK * ROW :]
    codes_at = (2 * KV_HEADS + 1) * DIM
    assert (padding[codes_at : codes_at + DIM] == 7).all()
    scales = padding[BLOCK * KV_HEADS * DIM :].view(torch.float32)
    assert scales[31 * KV_HEADS + 1] == 0.5
    assert (view == 0).all()  # no token of any page was touched
    assert int((buffer.view(torch.int8) != 0).sum()) == DIM + 1  # 64 codes, and 0.5 = 0x3f000000: one byte


def test_page_sketch_refuses_a_page_without_room_for_it():
    _, view = padded_layer_view(pad_rows=1)
    with pytest.raises(ConfigError, match="has no such rows"):
        page_sketch(view, DIM)
