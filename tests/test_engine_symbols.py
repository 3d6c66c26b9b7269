"""Every vLLM symbol kvreuse touches (``kvreuse.patches.vllm_0_32.MANIFEST``: the internals behind the boundary's
functions and the interface the adapters use) exists in the installed vLLM with the expected signature."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engine_symbols import (  # noqa: E402
    assert_every_boundary_function_is_in_the_manifest,
    assert_symbol,
    boundary,
    symbol_id,
)

VLLM = boundary("vllm_0_32")


@pytest.mark.parametrize("symbol", VLLM.MANIFEST.symbols(), ids=symbol_id)
def test_the_installed_vllm_has_the_symbol(symbol):
    assert_symbol(symbol)


def test_every_boundary_function_records_the_internals_it_touches():
    assert_every_boundary_function_is_in_the_manifest(VLLM)
    assert len(VLLM.MANIFEST.internal) >= 30
