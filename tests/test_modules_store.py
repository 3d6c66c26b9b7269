"""The tiered module store: eviction policies, demotion, disk round trips, capacity, failures, prefetch."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreuse.errors import ConfigError, ModuleConflict, ModuleQuotaExceeded
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.store import (
    NO_CONTEXT,
    EncodedModule,
    ModuleKey,
    ModuleMismatch,
    ModuleStore,
    ModuleTooLarge,
    context_fingerprint,
    module_fingerprint,
)

MODEL, TOKENIZER = "local/small", "local/small-bpe"
# One token of one layer with 1 head of dim 4 in fp32: 2 (k, v) * 4 * 4 bytes = 32 bytes per token.
TOKEN_BYTES = 32


def module(
    name,
    tokens=4,
    *,
    seed=None,
    dtype=torch.float32,
    layers=1,
    model=MODEL,
    tokenizer=TOKENIZER,
    start=0,
    first_id=None,
    **fields,
):
    """A module of ``tokens`` tokens (``tokens * 32`` bytes in fp32 with the defaults) with distinct token ids."""
    generator = torch.Generator().manual_seed(seed if seed is not None else abs(hash(name)) % 2**31)
    kv = torch.randn(layers, 2, tokens, 1, 4, generator=generator).to(dtype)
    base = first_id if first_id is not None else 1000 * (abs(hash(name)) % 10_000)
    return EncodedModule(name, model, tokenizer, tuple(range(base, base + tokens)), start, kv, **fields)


def store(gpu=0, cpu=0, disk=0, eviction="lru", device_bytes=None, **kw):
    """A store whose device tier (``gpu`` bytes) sits on the CPU, labelled ``device``, so every tier is tested."""
    cfg = ModulesConfig(
        gpu_bytes=gpu, cpu_bytes=cpu, disk_bytes=disk, eviction=eviction, gpu_device="cpu", pin_cpu_memory=False, **kw
    )
    return ModuleStore(cfg, model_id=MODEL, tokenizer_id=TOKENIZER, device_bytes=device_bytes)


def test_config_reads_modules_variables_and_rejects_an_unknown_policy():
    cfg = ModulesConfig.load({"gpu_bytes": 1024}, environ={"KVREUSE_MODULES_EVICTION": "fifo"})
    assert (cfg.gpu_bytes, cfg.eviction, cfg.cpu_bytes) == (1024, "fifo", 8 * 1024**3)
    with pytest.raises(ConfigError, match=r"modules\.eviction .*'mru' is not one of lru, lfu, fifo"):
        ModulesConfig.load({"eviction": "mru"}, environ={})
    with pytest.raises(ConfigError, match="every tier is off"):
        store()


def test_encoded_module_layout_and_size():
    m = module("t", tokens=5, layers=3, dtype=torch.bfloat16, start=7)
    assert m.nbytes == 3 * 2 * 5 * 4 * 2 and m.dtype == torch.bfloat16 and m.num_layers == 3
    assert torch.equal(m.keys(1), m.kv[1, 0]) and m.keys(1).shape == (5, 1, 4) and m.start == 7


@pytest.mark.parametrize(("policy", "evicted"), [("lru", "c"), ("lfu", "b"), ("fifo", "a")])
def test_policy_chooses_the_module_that_leaves_a_full_tier(policy, evicted):
    # gpu holds 3 modules of 128 bytes. a, b, c are put in that order, then read c, c, c, b, a.
    # Uses (put + gets): a 2, b 2, c 4; last use: c before b before a. When d needs room, LRU moves c (used
    # longest ago), LFU moves b (fewest uses; a tie with a broken by the older last use), FIFO moves a (first in).
    s = store(gpu=3 * 128, cpu=10 * 128, eviction=policy)
    a, b, c, d = (module(n) for n in "abcd")
    for m in (a, b, c):
        s.put(m)
    for m in (c, c, c, b, a):
        s.get(m.key)
    s.put(d)
    assert [s.tier_of(s.current(n)) for n in "abcd"] == ["cpu" if n == evicted else "device" for n in "abcd"]
    assert s.figures.evictions["device"] == 1 and s.figures.moves["device->cpu"] == 1


def test_lru_and_fifo_differ_when_the_first_in_was_used_last():
    # a put first but read last: FIFO still evicts a, LRU evicts b.
    for policy, evicted in (("lru", "b"), ("fifo", "a")):
        s = store(gpu=2 * 128, cpu=4 * 128, eviction=policy)
        s.put(module("a"))
        s.put(module("b"))
        s.get(s.current("a"))
        s.put(module("c"))
        assert s.tier_of(s.current(evicted)) == "cpu", policy


def test_demotion_chain_gpu_cpu_disk_then_drop():
    # each tier holds one 128-byte module: the 4th put pushes a from gpu to cpu to disk and then off the store.
    with store(gpu=128, cpu=128, disk=128) as s:
        a, b, c, d = (module(n) for n in "abcd")
        s.put(a)
        assert s.tier_of(a.key) == "device"
        s.put(b)
        assert (s.tier_of(a.key), s.tier_of(b.key)) == ("cpu", "device")
        s.put(c)
        assert [s.tier_of(m.key) for m in (a, b, c)] == ["disk", "cpu", "device"]
        s.put(d)
        assert [s.tier_of(m.key) for m in (a, b, c, d)] == [None, "disk", "cpu", "device"]
        f = s.figures
        assert (f.moves["device->cpu"], f.moves["cpu->disk"], f.drops) == (3, 2, 1)
        assert f.bytes_moved["device->cpu"] == 3 * 128 and f.evictions == {"device": 3, "cpu": 2, "disk": 1}
        assert s.get(a.key) is None and s.figures.misses == 1


def test_get_promotes_to_the_fastest_tier_and_counts_the_hit_where_found():
    with store(gpu=128, cpu=128, disk=128) as s:
        a, b, c = (module(n) for n in "abc")
        for m in (a, b, c):
            s.put(m)
        got = s.get(a.key)  # on disk
        assert torch.equal(got.kv, a.kv) and s.tier_of(a.key) == "device"
        assert [s.tier_of(m.key) for m in (b, c)] == ["disk", "cpu"]  # c demoted to cpu, b to disk
        assert s.figures.hits == {"disk": 1} and s.figures.moves["disk->device"] == 1
        assert s.figures.promotions("device") == 1


def test_module_larger_than_fast_tiers_goes_to_the_first_tier_that_fits():
    with store(gpu=128, cpu=512) as s:
        big = module("big", tokens=8)  # 256 bytes
        assert s.put(big) == "cpu"
        assert s.get(big.key) is not None and s.tier_of(big.key) == "cpu"  # stays: the device tier cannot hold it
        assert s.figures.hits == {"cpu": 1} and not s.figures.moves


def test_module_larger_than_every_tier_is_refused():
    with store(gpu=128, cpu=256) as s:
        with pytest.raises(
            ModuleTooLarge,
            match=r"'huge' holds 320 bytes of KV, more than any tier \(device: 128, "
            r"cpu: 256\)",
        ):
            s.put(module("huge", tokens=10))
        assert len(s) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_disk_round_trip_is_bit_exact(dtype):
    with store(gpu=1, disk=1 << 20) as s:  # gpu too small: the module lives on disk
        m = module("t", tokens=7, layers=3, dtype=dtype, start=42, adapter="lora:abc")
        m.kv[0, 0, 0, 0, 0] = float("nan")
        m.kv[0, 1, 0, 0, 1] = -0.0
        expected = m.kv.clone()
        assert s.put(m) == "disk"
        got = s.get(m.key)
        assert got.kv.dtype == dtype
        assert torch.equal(got.kv.view(torch.uint8), expected.view(torch.uint8))
        assert (got.name, got.token_ids, got.start, got.adapter, got.key) == ("t", m.token_ids, 42, "lora:abc", m.key)


def test_disk_file_is_written_atomically_one_file_per_module():
    with tempfile.TemporaryDirectory() as folder:
        with store(cpu=1, disk=1 << 20, disk_dir=folder) as s:
            for n in "abc":
                s.put(module(n))
            assert len(list(Path(folder).glob("*.safetensors"))) == 3
            assert not list(Path(folder).glob(".*tmp"))
            s.evict(s.current("b"))
            assert len(list(Path(folder).glob("*.safetensors"))) == 2
        assert not list(Path(folder).iterdir())  # close deletes the store's files


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_disk_file_gives_none_and_counts_a_load_failure(damage):
    with tempfile.TemporaryDirectory() as folder:
        with store(cpu=1, disk=1 << 20, disk_dir=folder) as s:
            m = module("t", tokens=16)
            s.put(m)
            (path,) = Path(folder).glob("*.safetensors")
            raw = path.read_bytes()
            if damage == "missing":
                path.unlink()
            elif damage == "truncated":
                path.write_bytes(raw[: len(raw) // 2])
            else:  # one bit of the last KV value: a readable file with wrong contents
                path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
            assert s.get(m.key) is None
            assert s.figures.load_failures == 1 and m.key not in s and s.used_bytes()["disk"] == 0
            assert s.get(m.key) is None and s.figures.misses == 1  # then it is simply unknown


def test_damaged_file_of_a_module_being_promoted_gives_none_and_leaves_the_tiers_consistent():
    with tempfile.TemporaryDirectory() as folder:
        with store(cpu=512, disk=1 << 20, disk_dir=folder) as s:
            m, other = module("t", tokens=16), module("u", tokens=16)  # 512 bytes each
            s.put(m)
            s.put(other)  # pushes m down to disk
            assert s.tier_of(m.key) == "disk"
            (path,) = Path(folder).glob("*.safetensors")
            path.write_bytes(b"not a safetensors file")
            assert s.get(m.key) is None and s.figures.load_failures == 1
            assert s.used_bytes() == {"cpu": 512, "disk": 0} and s.tier_of(other.key) == "cpu"


def test_module_of_another_model_or_tokenizer_is_refused():
    with store(gpu=1 << 20) as s:
        with pytest.raises(
            ModuleMismatch,
            match=r"encoded for model 'other/model', but this store serves model "
            r"'local/small'",
        ):
            s.put(module("t", model="other/model"))
        with pytest.raises(ModuleMismatch, match="tokenizer 'other-bpe'"):
            s.put(module("t", tokenizer="other-bpe"))
        # the same name and ids under another model or tokenizer is another key: never found by this store
        foreign = module("t", model="other/model")
        s.put(module("t"))
        assert foreign.key.fingerprint != s.current("t").fingerprint and s.get(foreign.key) is None
        assert s.get(s.current("t")) is not None


def test_prefetch_promotes_in_order_up_to_the_depth():
    with store(gpu=2 * 128, cpu=8 * 128, prefetch_depth=2) as s:
        ms = [module(n) for n in "abcde"]
        for m in ms:
            s.put(m)  # a, b, c on cpu; d, e on gpu
        assert [s.tier_of(m.key) for m in ms] == ["cpu", "cpu", "cpu", "device", "device"]
        assert s.prefetch([ms[0].key, ms[1].key, ms[2].key], background=False).result() == 2
        assert [s.tier_of(m.key) for m in ms] == ["device", "device", "cpu", "cpu", "cpu"]
        assert s.figures.prefetched == 2 and not s.figures.hits  # prefetch counts no hits


def test_background_prefetch_promotes_while_the_caller_reads():
    with store(gpu=4 * 128, cpu=1 << 20, disk=0) as s:
        ms = [module(f"m{i}", first_id=100 * i) for i in range(12)]
        for m in ms:
            s.put(m)
        cold = [m.key for m in ms[:4]]
        future = s.prefetch(cold)
        for m in ms[4:]:
            assert torch.equal(s.get(m.key).kv, m.kv)
        future.result(timeout=10)
        assert all(s.tier_of(k) in ("device", "cpu") for k in cold)
        assert s.used_bytes()["device"] <= 4 * 128


def test_prefetch_order_cuts_promotions_on_clustered_requests():
    # Three clusters of two modules each; requests arrive interleaved (A, B, C, A, B, C, ...), 5 of each.
    # The gpu tier holds one cluster (the last put, z): in arrival order every request promotes its 2 modules
    # from cpu (15 * 2 = 30); reranked (x x x x x y ... z ...), only the first request of each cluster does (3 * 2).
    clusters = [[module(f"{c}{i}", first_id=1000 * j + 10 * i) for i in range(2)] for j, c in enumerate("xyz")]
    requests = [clusters[i % 3] for i in range(15)]

    def promotions(order):
        with store(gpu=2 * 128, cpu=1 << 20) as s:
            for cluster in clusters:
                for m in cluster:
                    s.put(m)
            for i in order:
                for m in requests[i]:
                    assert s.get(m.key) is not None
            return s.figures.promotions("device"), s

    arrival, s = promotions(range(15))
    order = s.prefetch_order([[m.key for m in r] for r in requests])
    reranked, _ = promotions(order)
    assert sorted(order) == list(range(15))
    assert (arrival, reranked) == (30, 6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caps=st.tuples(*[st.integers(0, 6)] * 3).filter(any),
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "get", "get", "evict"]), st.integers(0, 7), st.integers(1, 5)), max_size=30
    ),
    policy=st.sampled_from(["lru", "lfu", "fifo"]),
)
def test_capacity_is_never_exceeded(caps, ops, policy):
    # capacities in units of 64 bytes (2 tokens); modules of 1-5 units. After every call: no tier over its
    # capacity, a get returns exactly what was put (or None), one disk file per module on the disk tier.
    with tempfile.TemporaryDirectory() as folder:
        with store(*(64 * c for c in caps), eviction=policy, disk_dir=folder) as s:
            put: dict = {}
            for op, i, units in ops:
                m = module(f"m{i}", tokens=2 * units, first_id=100 * i, seed=i)
                if op == "put":
                    if m.nbytes > 64 * max(caps):
                        with pytest.raises(ModuleTooLarge):
                            s.put(m, replace=True)
                        continue
                    s.put(m, replace=True)  # the same name with another size is other content: a replacement
                    put[m.key] = m.kv.clone()
                elif op == "get":
                    key = s.current(m.name)
                    got = s.get(key) if key is not None else None
                    assert (got is not None) == (key is not None) and (key is None or key in put)
                    if got is not None:
                        assert torch.equal(got.kv, put[key])
                else:
                    s.evict(s.current(m.name) or m.key)
                for name, used in s.used_bytes().items():
                    assert used <= s.capacities()[name], (name, used)
                on_disk = sum(s.tier_of(key) == "disk" for key in put)
                assert len(list(Path(folder).glob("*.safetensors"))) == on_disk


def test_keys_name_everything_the_kv_depends_on():
    ids = (1, 2, 3)
    base = module_fingerprint(MODEL, TOKENIZER, ids)
    variants = [
        module_fingerprint("other", TOKENIZER, ids),
        module_fingerprint(MODEL, "other", ids),
        module_fingerprint(MODEL, TOKENIZER, (1, 2, 4)),
        module_fingerprint(MODEL, TOKENIZER, ids, context=context_fingerprint([9, 9])),
        module_fingerprint(MODEL, TOKENIZER, ids, start=2),
        module_fingerprint(MODEL, TOKENIZER, ids, recovery="cacheblend"),
        module_fingerprint(MODEL, TOKENIZER, ids, adapter="lora:x"),
    ]
    assert len({base, *variants}) == 8
    assert module_fingerprint(MODEL, TOKENIZER, ids, context=NO_CONTEXT, start=0, recovery="none") == base
    m = module("t", context=context_fingerprint([5]), recovery="none", start=1)
    assert m.key.fingerprint == module_fingerprint(
        MODEL, TOKENIZER, m.token_ids, context=context_fingerprint([5]), start=1
    )


def test_a_reencode_after_another_context_is_another_encoding_and_never_the_names_entry():
    # The poisoning scenario, engine-free: an operator's module, then the same name and tokens after a hostile
    # context. It is kept as another encoding of the name, which a prompt takes only where it holds that context
    # (tests/test_modules_encodings.py); the name's entry stays the operator's, also once that one leaves.
    with store(cpu=1 << 20) as s:
        clean = module("system", seed=1)
        s.put(clean)
        hostile = module("system", seed=2, context=context_fingerprint([666] * 8), start=8)
        s.put(hostile)
        assert s.current("system") == clean.key and torch.equal(s.get(clean.key).kv, clean.kv)
        assert s.encodings("system") == [clean.key, hostile.key] and hostile.key != clean.key
        with pytest.raises(ModuleConflict, match="'system' is already stored in namespace global with other content"):
            s.put(module("system", seed=3, first_id=7))  # other tokens under the name: refused as before
        assert len(s) == 2
        s.evict(clean.key)
        assert s.current("system") is None and s.encodings("system") == [hostile.key]


def test_an_adapters_encoding_is_its_own_entry_and_its_own_primary():
    with store(cpu=1 << 20) as s:
        base, lora = module("doc", seed=1), module("doc", seed=2, adapter="lora:x")
        s.put(base)
        s.put(lora)
        assert base.key.fingerprint != lora.key.fingerprint and len(s) == 2
        assert s.current("doc") == base.key and s.current("doc", adapter="lora:x") == lora.key
        s.put(module("doc", seed=3, adapter="lora:x"))  # the same encoding again: the stored entry stays
        assert len(s) == 2 and torch.equal(s.get(lora.key).kv, lora.kv)
        fresh = module("doc", seed=4)
        s.put(fresh, replace=True)  # a replace starts the name over: every encoding of it leaves
        assert s.encodings("doc") == [fresh.key] and s.current("doc", adapter="lora:x") is None


def test_the_same_content_again_keeps_the_stored_kv_and_its_version():
    with store(cpu=1 << 20) as s:
        first, again = module("t", seed=1), module("t", seed=2)  # same fingerprint, other numbers
        s.put(first)
        s.put(again)
        assert again.key == first.key and torch.equal(s.get(first.key).kv, first.kv)


def test_an_explicit_replace_swaps_atomically_under_a_version_never_used_before():
    with store(cpu=1 << 20) as s:
        old = module("t", seed=1)
        s.put(old)
        new = module("t", seed=2, context=context_fingerprint([4]))
        s.put(new, replace=True)
        assert s.current("t") == new.key and new.key.version > old.key.version and len(s) == 1
        assert new.key.identity != old.key.identity and len(new.key.identity) == 32
        assert old.key not in s and s.get(old.key) is None and torch.equal(s.get(new.key).kv, new.kv)
        s.evict(new.key)  # gone, then the first content again: still a new version, never an old one
        back = module("t", seed=1)
        s.put(back)
        assert s.current("t") == back.key and back.key.version > new.key.version > old.key.version


def test_namespaces_hold_the_same_name_apart_and_a_name_leaves_with_its_entry():
    with store(gpu=128, cpu=0) as s:
        mine, theirs = module("doc", seed=1, namespace="salt-a"), module("doc", seed=2, namespace="salt-b")
        s.put(mine)
        assert (
            s.current("doc", "salt-a") == mine.key and s.current("doc", "salt-b") is None and s.current("doc") is None
        )
        s.put(theirs)  # the only tier holds one module: mine is dropped, and its name with it
        assert s.current("doc", "salt-a") is None and s.current("doc", "salt-b") == theirs.key
        assert mine.key.namespace == "salt-a" and theirs.key != mine.key


def test_a_tenant_past_its_quota_drops_its_own_modules_never_another_namespaces():
    # Quota 3 modules of 128 bytes per tenant; the host tier holds 16 modules, so only the quota drops anything.
    with store(cpu=16 * 128, namespace_bytes=3 * 128) as s:
        a = [module(f"a{i}", namespace="tenant-a") for i in range(5)]
        b, shared = module("b0", namespace="tenant-b"), module("system")
        for m in (a[0], a[1], b, shared, a[2]):
            s.put(m)
        assert s.namespace_bytes("tenant-a") == 3 * 128
        s.get(a[0].key)  # used last: lru keeps it
        s.put(a[3])
        s.put(a[4])
        assert [m.key in s for m in a] == [True, False, False, True, True]  # a1 and a2, the least recently used
        assert b.key in s and shared.key in s and s.current("a1", "tenant-a") is None
        assert s.namespace_bytes("tenant-a") == 3 * 128 and s.namespace_bytes("tenant-b") == 128
        assert s.figures.drops == 2
        # The global namespace has no quota.
        for i in range(6):
            s.put(module(f"g{i}"))
        assert s.namespace_bytes() == 7 * 128


def test_a_module_larger_than_its_namespaces_quota_is_refused_and_nothing_leaves():
    with store(cpu=16 * 128, namespace_bytes=2 * 128) as s:
        kept = module("small", namespace="tenant-a")
        s.put(kept)
        with pytest.raises(ModuleQuotaExceeded, match=r"more than namespace tenant-[0-9a-f]{8} may hold"):
            s.put(module("big", tokens=12, namespace="tenant-a"))  # 384 bytes
        assert kept.key in s and len(s) == 1
        s.put(module("big", tokens=12))  # the same module is global: no quota


@pytest.mark.parametrize("protect", [True, False])
def test_a_tenants_flood_never_moves_global_modules_unless_the_operator_says_so(protect):
    # The device tier holds 2 modules, the host tier 2: the operator's two modules fill the device tier, then a
    # tenant writes 10 modules.
    with store(gpu=2 * 128, cpu=2 * 128, protect_global=protect) as s:
        system, rules = module("system"), module("rules")
        s.put(system)
        s.put(rules)
        flood = [module(f"f{i}", namespace="mallory") for i in range(10)]
        for m in flood:
            s.put(m)
        tiers = (s.tier_of(system.key), s.tier_of(rules.key))
        if protect:
            assert tiers == ("device", "device")  # untouched; the flood took the host tier and dropped its own
            assert [m.key in s for m in flood] == [False] * 8 + [True, True]
        else:
            assert tiers == (None, None)  # pushed down, then out of the store, by the tenant's writes
        # A tenant's read promotes its module only into room no global module holds.
        assert s.get(flood[-1].key) is not None
        assert s.tier_of(flood[-1].key) == ("cpu" if protect else "device")


def test_a_tenants_module_with_no_room_left_by_global_modules_is_refused():
    with store(gpu=2 * 128, namespace_bytes=4 * 128) as s:
        system, rules = module("system"), module("rules")
        s.put(system)
        s.put(rules)
        with pytest.raises(ModuleQuotaExceeded, match="held by global modules"):
            s.put(module("mine", namespace="tenant-a"))
        assert system.key in s and rules.key in s and s.namespace_bytes("tenant-a") == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caps=st.tuples(*[st.integers(0, 6)] * 3).filter(any),
    quota=st.integers(0, 8),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "get", "evict"]),
            st.sampled_from(["", "tenant-a", "tenant-b"]),
            st.integers(0, 5),
            st.integers(1, 4),
        ),
        max_size=30,
    ),
    policy=st.sampled_from(["lru", "lfu", "fifo"]),
)
def test_quotas_and_protected_global_modules_hold_after_every_call(caps, quota, ops, policy):
    # Capacities and the quota in units of 64 bytes (0: off). After every call: no tenant holds more than its
    # quota; a tenant's call moved no global module (tier unchanged, still stored); no tier is over capacity.
    with tempfile.TemporaryDirectory() as folder:
        with store(*(64 * c for c in caps), eviction=policy, disk_dir=folder, namespace_bytes=64 * quota) as s:
            known: set = set()
            for op, namespace, i, units in ops:
                m = module(f"m{i}", tokens=2 * units, first_id=100 * i, seed=i, namespace=namespace)
                before = {key: s.tier_of(key) for key in known if key.namespace == ""}
                try:
                    if op == "put":
                        s.put(m, replace=True)
                        known.add(m.key)
                    elif op == "get":
                        key = s.current(m.name, namespace)
                        if key is not None:
                            s.get(key)
                    else:
                        s.evict(s.current(m.name, namespace) or m.key)
                except ModuleTooLarge:
                    pass  # ModuleQuotaExceeded too: nothing changed, checked below
                if namespace:
                    assert {key: s.tier_of(key) for key in before} == before
                    if quota:
                        assert s.namespace_bytes(namespace) <= 64 * quota
                for name, used in s.used_bytes().items():
                    assert used <= s.capacities()[name], (name, used)
                assert sum(s.namespace_bytes(n) for n in ("", "tenant-a", "tenant-b")) == sum(s.used_bytes().values())


def test_no_cuda_means_no_gpu_tier_and_auto_takes_the_adapters_budget():
    # the default device tier is auto: without a budget from the adapter it is off, GPU or not
    assert ModuleStore(ModulesConfig(), model_id=MODEL, tokenizer_id=TOKENIZER).tiers == ("cpu",)
    with_budget = ModuleStore(ModulesConfig(), model_id=MODEL, tokenizer_id=TOKENIZER, device_bytes=1 << 30)
    assert with_budget.tiers == (("gpu", "cpu") if torch.cuda.is_available() else ("cpu",))  # no host memory as gpu
    assert store(gpu=-1, cpu=64, device_bytes=1024).capacities() == {"device": 1024, "cpu": 64}
    assert store(gpu=-1, cpu=64).capacities() == {"cpu": 64}
    assert store(gpu=512, cpu=64, device_bytes=1024).capacities() == {"device": 512, "cpu": 64}


def test_every_modules_setting_is_documented():
    from kvreuse.config import describe

    rows = describe(ModulesConfig, "modules")
    assert [key for key, *_ in rows] == [
        "modules.gpu_bytes",
        "modules.cpu_bytes",
        "modules.disk_bytes",
        "modules.disk_dir",
        "modules.eviction",
        "modules.pin_cpu_memory",
        "modules.prefetch_depth",
        "modules.gpu_device",
        "modules.namespace_bytes",
        "modules.protect_global",
        "modules.open_writes",
        "modules.index_bytes",
        "modules.recompute_first",
        "modules.recompute_share",
        "modules.recompute_budget",
        "modules.recompute_blend",
        "modules.blend_layers",
        "modules.ape_temperature",
        "modules.ape_scale",
        "modules.shadow_every",
        "modules.shadow_normalise",
    ]
    assert all(doc for *_, doc in rows)


def test_kvreuses_own_reads_are_not_module_hits_nor_uses():
    # A probe reads the stored entry to rank its tokens: no splice, so no hit (issue: probes counted as hits), and
    # no use for the eviction policy.
    with store(cpu=2 * 128, eviction="lfu") as s:
        probed, spliced = module("probed"), module("spliced")
        s.put(probed)
        s.put(spliced)
        for _ in range(3):
            assert torch.equal(s.get(probed.key, use=False).kv, probed.kv)
        assert s.get(ModuleKey("gone", "0"), use=False) is None
        assert sum(s.figures.hits.values()) == 0 and s.figures.misses == 0
        s.get(spliced.key)
        assert s.figures.hits == {"cpu": 1}
        s.put(module("third"))  # lfu: the probed module has no use of its own, so it leaves first
        assert probed.key not in s and spliced.key in s
