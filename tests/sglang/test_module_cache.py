"""``--radix-cache-backend kvreuse_modules``: SGLang's real ``RadixCache`` (subclassed), KV pool and allocator.

The KV pool is a real ``MHATokenToKVPool`` (2 layers, 2 KV heads, head_dim 64, page size 1) with SGLang's real
``TokenToKVPoolAllocator``. A "computed" request is what SGLang's model would leave in the pool: for each token a
content key rotated by RoPE to the token's position (``apply_rope_reference``), and a value; SGLang then inserts
the request's tokens and slots into the tree, which is where the cache learns modules. Three 12-token modules
``T1``, ``T2``, ``T3`` are registered.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch
from numerics import assert_within, rotation_bound
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext

from kvreuse.errors import ConfigError
from kvreuse.kernels.rerotate import RopeSpec, apply_rope_reference
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.store import ModuleStore
from kvreuse.sglang.module_cache import ModuleRadixCache, create_module_radix_cache

LAYERS, KV_HEADS, DIM, SLOTS = 2, 2, 64, 512
ROPE = RopeSpec(head_dim=DIM, rotary_dim=DIM)
T1, T2, T3 = [list(range(5000 + 100 * k, 5012 + 100 * k)) for k in range(3)]
X = [7, 8, 9, 10, 11]  # free text


class World:
    def __init__(self, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.pool = MHATokenToKVPool(
            size=SLOTS,
            page_size=1,
            dtype=torch.float32,
            head_num=KV_HEADS,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self.allocator = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", self.pool, need_sort=False)
        self.store = ModuleStore(ModulesConfig(gpu_bytes=1 << 24, cpu_bytes=1 << 24), model_id="m", tokenizer_id="t")
        params = CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator, page_size=1
        )
        self.cache = ModuleRadixCache(params, store=self.store, rope=ROPE, modules=[("t1", T1), ("t2", T2), ("t3", T3)])
        # Position-free content of every token id: keys before RoPE, and values.
        self.content: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def token(self, tid: int) -> tuple[torch.Tensor, torch.Tensor]:
        if tid not in self.content:
            self.content[tid] = (
                torch.randn(LAYERS, KV_HEADS, DIM, generator=self.g),
                torch.randn(LAYERS, KV_HEADS, DIM, generator=self.g),
            )
        return self.content[tid]

    def exact_keys(self, ids: list[int], start: int, layer: int) -> torch.Tensor:
        """Keys of ``ids`` encoded at ``start`` onwards, float64."""
        raw = torch.stack([self.token(t)[0][layer] for t in ids]).double()
        return apply_rope_reference(raw, torch.arange(start, start + len(ids)), ROPE)

    def expected_keys(self, ids: list[int], start: int, layer: int) -> torch.Tensor:
        """What SGLang's model would leave in the pool: the exact keys rounded once to float32."""
        return self.exact_keys(ids, start, layer).float()

    def compute(self, ids: list[int]) -> torch.Tensor:
        """A request SGLang computed: its KV in newly allocated slots, then inserted into the tree."""
        slots = self.allocator.alloc(len(ids))
        for layer in range(LAYERS):
            self.pool.get_key_buffer(layer)[slots] = self.expected_keys(ids, 0, layer)
            self.pool.get_value_buffer(layer)[slots] = torch.stack([self.token(t)[1][layer] for t in ids])
        self.cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=slots))
        return slots

    def match(self, ids: list[int]):
        result = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids))))
        return result.device_prefix_len, self.cache.path_device_indices(result.last_device_node)


def test_a_module_is_learnt_from_the_request_that_computed_it_with_its_position():
    world = World()
    world.compute(X + T2 + [1, 2])
    module = world.store.get(world.store.current("t2"))
    assert module is not None and module.start == len(X) and module.kv.shape == (LAYERS, 2, 12, KV_HEADS, DIM)
    assert torch.equal(module.keys(1), world.expected_keys(T2, len(X), 1))  # learnt where computed: a copy
    assert world.store.current("t1") is None and world.cache.learnt_modules == 1


def test_modules_after_the_prefix_hit_are_spliced_at_their_new_positions():
    world = World()
    world.compute(T1 + [1, 2, 3])  # t1 learnt at position 0
    world.compute(X + T2 + [4])  # t2 learnt at position 5
    prompt = T2 + T1 + [6, 6, 6]  # neither module is where it was learnt; nothing of it is in the tree
    hit, slots = world.match(prompt)
    assert hit == 24 and world.cache.spliced_tokens == 24
    for layer in range(LAYERS):
        keys = world.pool.get_key_buffer(layer)[slots]
        exact = world.exact_keys(T2 + T1, 0, layer)
        assert_within(keys, exact, rotation_bound(keys, moves=2), f"layer {layer}")  # computed, then moved: 2 roundings
        values = world.pool.get_value_buffer(layer)[slots]
        assert torch.equal(values, torch.stack([world.token(t)[1][layer] for t in T2 + T1]))  # copies


def test_the_splice_starts_where_sglangs_own_hit_ends_and_stops_at_free_text():
    world = World()
    world.compute(T1 + [1])
    world.compute(T2 + [2])
    world.compute(X + [3])  # X is in the tree
    hit, slots = world.match(X + T1 + [9] + T2 + [4])
    assert hit == len(X) + 12 and world.cache.spliced_tokens == 12  # T2 comes after free text: computed
    keys = world.pool.get_key_buffer(0)[slots[len(X) :]]
    assert_within(keys, world.exact_keys(T1, len(X), 0), rotation_bound(keys, moves=2), "T1")


def test_a_spliced_module_is_shared_by_later_requests_like_any_cached_prefix():
    world = World()
    world.compute(T1 + [1])
    first, slots = world.match([3] + T1 + [4])
    assert first == 0  # free text first: nothing to splice
    world.compute(T3 + [5])
    first, slots = world.match(T3 + T1 + [4])
    again, slots_again = world.match(T3 + T1 + [8])
    assert first == again == 24 and torch.equal(slots, slots_again)
    assert world.cache.spliced_tokens == 12  # T3 came from the tree; T1 was spliced once


def test_the_prompts_last_token_is_never_spliced():
    world = World()
    world.compute(X + T1)
    hit, _ = world.match(T1)
    assert hit == 11


def test_a_module_the_store_lost_is_computed():
    world = World()
    world.compute(X + [0])
    world.compute(T1 + [1])
    world.store.evict(world.store.current("t1"))
    free = world.allocator.available_size()
    assert world.match(X + T1 + [2])[0] == len(X) and world.allocator.available_size() == free


def build_context(**server_args) -> TreeCacheBuildContext:
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=1)
    hf = SimpleNamespace(
        to_dict=lambda: {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "rope_theta": 10000.0}
    )
    return TreeCacheBuildContext(
        server_args=SimpleNamespace(
            model_path="m", tokenizer_path=None, attention_backend=None, decode_attention_backend=None, **server_args
        ),
        params=params,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=None,
        model_config=SimpleNamespace(hf_config=hf),
        tp_size=1,
        tp_rank=0,
        tp_group=None,
    )


def test_the_factory_builds_the_cache_from_sglangs_build_context(tmp_path, monkeypatch):
    path = tmp_path / "modules.json"
    path.write_text(f'{{"t1": {T1}}}')
    monkeypatch.setenv("KVREUSE_SGLANG_MODULES_FILE", str(path))
    monkeypatch.setenv("KVREUSE_MODULES_GPU_BYTES", "0")
    cache = create_module_radix_cache(build_context())
    assert isinstance(cache, ModuleRadixCache) and "t1" in cache.module_trie
    assert cache.rope.head_dim == 64 and cache.store.tiers == ("cpu",)


def test_the_factory_says_once_that_selective_recompute_does_not_apply(caplog):
    with caplog.at_level("INFO", logger="sglang.plugins.kvreuse.module_cache"):
        create_module_radix_cache(build_context())
    said = [r.getMessage() for r in caplog.records if "do not apply in SGLang" in r.getMessage()]
    assert len(said) == 1 and "recompute_first (16)" in said[0]


def test_the_factory_refuses_the_sparse_attention_backend():
    ctx = build_context()
    ctx.server_args.attention_backend = "kvreuse_sparse"
    with pytest.raises(ConfigError, match="kvreuse_sparse"):
        create_module_radix_cache(ctx)


def test_the_module_sets_policy_reads_the_modules_of_the_module_cache():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvreuse.reorder.config import ReorderConfig
    from kvreuse.sglang.scheduler import KVReuseSchedulePolicy
    from kvreuse.sglang.settings import SGLangConfig

    world = World()
    policy = KVReuseSchedulePolicy(
        "fcfs",
        world.cache,
        False,
        False,
        False,
        settings=SGLangConfig(schedule_policy="module-sets"),
        reorder=ReorderConfig(),
    )
    assert policy.module_trie is world.cache.module_trie
    waiting = []
    for arrival, (rid, ids) in enumerate([("t1", T1 + [1]), ("t3", T3 + [2]), ("t1b", T1 + [3])]):
        waiting.append(Req(rid, "", array("q", ids), SamplingParams(max_new_tokens=4)))
        waiting[-1].time_stats.wait_queue_entry_time = float(arrival)
    policy.calc_priority(waiting)
    assert [r.rid for r in waiting] == ["t1", "t1b", "t3"]
