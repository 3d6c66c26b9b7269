"""Key re-rotation (``kvreuse.kernels.rerotate``): the Triton kernel in the interpreter against the float64
reference, RoPE composition, and the refusal of encodings that cannot be re-applied."""

from __future__ import annotations

import math

import pytest
import torch
from numerics import DEVICE, assert_within, rotation_bound

from kvreuse.errors import KernelArgumentError, KVReuseError
from kvreuse.kernels.rerotate import (
    KeyRerotation,
    RopeSpec,
    UnsupportedPositionalEncoding,
    apply_rope_reference,
    check_rerotation,
    rerotate_keys,
    rerotate_keys_reference,
    rope_spec_from_hf_config,
)

LLAMA31 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
SPECS = {
    "neox": RopeSpec(head_dim=64, rotary_dim=64),
    "gptj-partial": RopeSpec(head_dim=40, rotary_dim=24, interleaved=True),
    "neox-partial-linear": RopeSpec(head_dim=24, rotary_dim=12, rope_type="linear", factor=4.0),
    "llama3": RopeSpec(head_dim=64, rotary_dim=64, theta=500000.0, **LLAMA31),
}


def _keys(n, heads, dim, dtype=torch.float32, seed=0):
    """Random keys on the kernel tests' device (the references take them from any device)."""
    return torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference_on_awkward_sizes(name, dtype):
    spec = SPECS[name]
    keys = _keys(13, 3, spec.head_dim, dtype)
    deltas = torch.tensor([0, 1, -5, 7, 100, 4096, 33, 2, 99999, -1, 8, 3, 517])
    got = rerotate_keys(keys, deltas, spec).double()
    want = rerotate_keys_reference(keys, deltas, spec)
    assert_within(got, want, rotation_bound(keys), f"{name} {dtype}")
    tail = slice(spec.rotary_dim, spec.head_dim)
    assert torch.equal(got[..., tail], keys[..., tail].double())  # unrotated coordinates copied exactly


@pytest.mark.parametrize("name", SPECS)
def test_key_at_zero_moved_by_delta_equals_key_encoded_at_delta(name):
    spec = SPECS[name]
    raw = _keys(6, 2, spec.head_dim, seed=1)
    at_zero = apply_rope_reference(raw, torch.zeros(6, dtype=torch.long), spec).float().to(DEVICE)
    deltas = torch.tensor([3, 50, 1000, 8191, 20000, 131071])
    moved = rerotate_keys(at_zero, deltas, spec).double()
    # Two roundings: the key at 0 to fp32, then the move.
    assert_within(moved, apply_rope_reference(raw, deltas, spec), rotation_bound(at_zero, moves=2), name)


@pytest.mark.parametrize("name", SPECS)
def test_moving_to_p1_then_p2_equals_moving_to_p2(name):
    spec = SPECS[name]
    keys = apply_rope_reference(_keys(5, 4, spec.head_dim, seed=2), torch.arange(5), spec).float().to(DEVICE)
    p1, p2 = torch.tensor([10, 200, 3000, 40, 5]), torch.tensor([7, 9000, 12, 40000, 5])
    twice = rerotate_keys(rerotate_keys(keys, p1, spec), p2 - p1, spec)
    once = rerotate_keys(keys, p2, spec)
    assert_within(twice, once, rotation_bound(keys, moves=3), name)  # two moves' errors and one's, apart


def test_in_place_move_of_a_strided_cache_slice_leaves_values_and_other_slots_alone():
    spec = SPECS["gptj-partial"]
    cache = _keys(2 * 9, 3, spec.head_dim, seed=3).view(9, 2, 3, spec.head_dim)  # [slots, K/V, heads, dim]
    before = cache.clone()
    keys = cache[2:7, 0]  # token stride 2 * 3 * head_dim
    rotation = KeyRerotation(spec)
    rotation.plan(torch.full((5,), 11), device=DEVICE)
    rotation.run(keys, out=keys)
    want = rerotate_keys_reference(before[2:7, 0], torch.full((5,), 11), spec)
    assert_within(cache[2:7, 0], want, rotation_bound(before[2:7, 0]), "in place")
    assert torch.equal(cache[:, 1], before[:, 1]) and torch.equal(cache[:2], before[:2])  # untouched: bitwise


def test_llama3_frequencies_follow_metas_llama31_apply_scaling():
    # apply_scaling of meta-llama/llama-models (models/llama3/reference_impl/model.py), one frequency at a time.
    def apply_scaling(freq, factor=8.0, low=1.0, high=4.0, old=8192):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            return freq
        if wavelen > old / low:
            return freq / factor
        smooth = (old / wavelen - low) / (high - low)
        return (1 - smooth) * freq / factor + smooth * freq

    spec = rope_spec_from_hf_config(
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA31,
        }
    )
    plain = [500000.0 ** (-i / 128) for i in range(0, 128, 2)]
    want = torch.tensor([apply_scaling(f) for f in plain], dtype=torch.float64)
    # Both sides are a dozen float64 operations (u = 1.1e-16), a power and an interpolation that amplifies no error
    # by more than a few: 1e-12 is far above their rounding and far below a formula's difference (> 1e-3).
    assert torch.allclose(spec.inv_freq(), want, rtol=1e-12, atol=0)
    assert (spec.inv_freq() < torch.tensor(plain, dtype=torch.float64)).sum() > 0  # some are scaled


def test_hf_configs_are_read():
    assert rope_spec_from_hf_config(
        {
            "model_type": "llama",
            "head_dim": 64,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        }
    ) == RopeSpec(head_dim=64, rotary_dim=64)
    phi = rope_spec_from_hf_config(
        {
            "model_type": "phi",
            "hidden_size": 2560,
            "num_attention_heads": 32,
            "partial_rotary_factor": 0.4,
            "rope_theta": 10000.0,
        }
    )
    assert (phi.head_dim, phi.rotary_dim, phi.interleaved) == (80, 32, False)
    gptj = rope_spec_from_hf_config({"model_type": "gptj", "n_embd": 4096, "n_head": 16, "rotary_dim": 64})
    assert (gptj.head_dim, gptj.rotary_dim, gptj.interleaved) == (256, 64, True)
    neox = rope_spec_from_hf_config(
        {
            "model_type": "gpt_neox",
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "rotary_pct": 0.25,
            "rotary_emb_base": 10000,
        }
    )
    assert (neox.head_dim, neox.rotary_dim, neox.interleaved) == (128, 32, False)
    linear = rope_spec_from_hf_config(
        {
            "model_type": "llama",
            "hidden_size": 256,
            "num_attention_heads": 4,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        }
    )
    assert (linear.rope_type, linear.factor) == ("linear", 2.0)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (
            {
                "model_type": "llama",
                "hidden_size": 256,
                "num_attention_heads": 4,
                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
            },
            "dynamic NTK",
        ),
        (
            {
                "model_type": "qwen2",
                "hidden_size": 256,
                "num_attention_heads": 4,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
            },
            "YaRN",
        ),
        ({"model_type": "bloom", "hidden_size": 256, "n_head": 4}, "ALiBi"),
        ({"model_type": "falcon", "alibi": True}, "ALiBi"),
        ({"model_type": "gpt2", "n_embd": 256}, "learned absolute positions"),
        ({"model_type": "mystery", "hidden_size": 256, "num_attention_heads": 4}, "no rotary positional encoding"),
    ],
)
def test_encodings_that_cannot_be_reapplied_are_refused_saying_why(config, why):
    with pytest.raises(UnsupportedPositionalEncoding, match=why) as info:
        check_rerotation(config)
    assert isinstance(info.value, KVReuseError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_startup_check_passes_for_the_local_model_config(dtype):
    import json
    from pathlib import Path

    built = Path(__file__).resolve().parents[1] / "build/models/small/config.json"
    config = (
        json.loads(built.read_text())
        if built.exists()
        else {"model_type": "llama", "head_dim": 64, "hidden_size": 256, "num_attention_heads": 4}
    )
    assert check_rerotation(config, dtype=dtype, device=DEVICE) == RopeSpec(head_dim=64, rotary_dim=64)


def test_bad_arguments_name_the_tensor():
    rotation = KeyRerotation(SPECS["neox"])
    with pytest.raises(KernelArgumentError, match="before plan"):
        rotation.run(_keys(2, 1, 64))
    with pytest.raises(KernelArgumentError, match="deltas"):
        rotation.plan(torch.tensor([0.5]))
    rotation.plan(torch.tensor([1, 2]))
    with pytest.raises(KernelArgumentError, match="keys must be"):
        rotation.run(_keys(2, 1, 32))
    with pytest.raises(KernelArgumentError, match="fp16, bf16 or fp32"):
        rotation.run(_keys(2, 1, 64).double())


def test_many_heads_span_several_programs_and_an_empty_move_launches_nothing():
    spec = SPECS["neox-partial-linear"]
    keys = _keys(3, 19, spec.head_dim, seed=4)  # 19 heads: two programs of 16 per token
    deltas = torch.tensor([5, -7, 1234])
    got = rerotate_keys(keys, deltas, spec).double()
    assert_within(got, rerotate_keys_reference(keys, deltas, spec), rotation_bound(keys), "19 heads")
    assert rerotate_keys(keys[:0], deltas[:0], spec).shape == (0, 19, spec.head_dim)
