"""``--scheduler-cls kvreuse.vllm.PrefixAffinityScheduler`` on the real engine, against vLLM's own scheduler.

One shuffled workload (8 prompt prefixes of 200 tokens, 8 requests each) arrives online, 8 requests per engine
step, at an engine whose KV cache (32 blocks of 32 tokens) cannot keep every prefix and which runs at most 4
requests at a time, so the order in which waiting requests are admitted decides what the cache still holds.
Both engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the test can read the scheduler itself.
The affinity engine uses ``--scheduling-policy priority`` (all workload requests have the same priority), so
that one engine also shows that priority still wins.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from greedy import LOGPROBS, assert_same_greedy_path
from real_engine import start_llm, stop_llm

from kvreuse.reorder.affinity import ReorderCounters
from kvreuse.vllm.prefix_cache import PrefixCacheCounters, prefix_cache_counters

pytestmark = pytest.mark.engine

MAX_SKIPS = 8
PREFIXES, PER_PREFIX, PREFIX_TOKENS, SUFFIX_TOKENS, ARRIVALS_PER_STEP = 8, 8, 200, 20, 8
ENGINE = dict(max_model_len=512, kv_cache_memory_bytes=2 << 20, max_num_seqs=4, max_num_batched_tokens=2048)
AFFINITY = dict(
    scheduler_cls="kvreuse.vllm.PrefixAffinityScheduler",
    scheduling_policy="priority",
    # No waiting-time bound: on this slow machine it would admit nearly everything in arrival order.
    additional_config={"kvreuse": {"reorder": {"max_skips": MAX_SKIPS, "max_wait_s": 3600.0}}},
)


@dataclass(frozen=True)
class Run:
    outputs: dict  # request id -> vLLM CompletionOutput (greedy, with log-probabilities)
    cache: PrefixCacheCounters
    reorder: ReorderCounters | None


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 8000) for _ in range(n)]  # clear of the special tokens 0..2


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    import vllm.envs as envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        envs.disable_envs_cache()
        yield
    # An in-process engine core freezes vLLM's environment variables in this process; thaw them for later modules.
    envs.disable_envs_cache()


@pytest.fixture(scope="module")
def workload() -> dict[str, list[int]]:
    rng = random.Random(0)
    prefixes = [random_tokens(rng, PREFIX_TOKENS) for _ in range(PREFIXES)]
    order = [p for p in range(PREFIXES) for _ in range(PER_PREFIX)]
    rng.shuffle(order)
    return {f"req{n}-prefix{p}": prefixes[p] + random_tokens(rng, SUFFIX_TOKENS) for n, p in enumerate(order)}


def run_online(llm, workload: dict[str, list[int]]) -> Run:
    """Submit ``workload`` a few requests per engine step and step until every request has finished."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=LOGPROBS)
    pending, outputs = list(workload), {}
    before = prefix_cache_counters(llm)
    while pending or engine.has_unfinished_requests():
        for request_id in pending[:ARRIVALS_PER_STEP]:
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=workload[request_id]), params)
        del pending[:ARRIVALS_PER_STEP]
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
    reorder = getattr(scheduler_of(llm), "reorder_counters", lambda: None)()
    return Run(outputs, prefix_cache_counters(llm) - before, reorder)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


@pytest.fixture(scope="module")
def stock_run(small_model, in_process, workload) -> Run:
    llm = start_llm(small_model, **ENGINE)
    try:
        return run_online(llm, workload)
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def affinity_llm(small_model, in_process, stock_run):
    # Depends on stock_run so that the two engines never live at the same time.
    llm = start_llm(small_model, **ENGINE, **AFFINITY)
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="module")
def affinity_run(affinity_llm, workload) -> Run:
    return run_online(affinity_llm, workload)


def test_the_engine_builds_the_prefix_affinity_scheduler_with_its_queue(affinity_llm):
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvreuse.vllm.reorder.scheduler import AffinityRequestQueue, PrefixAffinityScheduler

    scheduler = scheduler_of(affinity_llm)
    assert type(scheduler) is PrefixAffinityScheduler and isinstance(scheduler, Scheduler)  # CPU: no async
    assert isinstance(scheduler.waiting, AffinityRequestQueue)
    assert (scheduler.reorder_config.max_skips, scheduler.reorder_config.max_wait_s) == (MAX_SKIPS, 3600.0)


def test_affinity_raises_vllms_prefix_cache_hit_rate_over_the_stock_scheduler(stock_run, affinity_run):
    prompt_tokens = PREFIXES * PER_PREFIX * (PREFIX_TOKENS + SUFFIX_TOKENS)
    assert stock_run.cache.queries == affinity_run.cache.queries == prompt_tokens
    print(
        f"\nvLLM prefix-cache hit rate: stock {stock_run.cache.hit_rate:.3f}, "
        f"PrefixAffinityScheduler {affinity_run.cache.hit_rate:.3f}"
    )
    # The best any order can do: every request but the first of each prefix hits its 6 full blocks.
    best = (PREFIXES * (PER_PREFIX - 1) * (PREFIX_TOKENS // 32) * 32) / prompt_tokens
    assert affinity_run.cache.hit_rate >= stock_run.cache.hit_rate + 0.15
    assert affinity_run.cache.hit_rate <= best


def test_greedy_outputs_agree_per_request_under_both_schedulers(stock_run, affinity_run):
    """vLLM's scheduler is the reference. The affinity scheduler batches requests differently and serves more of
    their prefixes from the cache (KV computed in another request's prefill): other matrix shapes, so other
    summation orders of the same math. Same tokens at every decided step, log-probabilities within rounding."""
    assert len(stock_run.outputs) == len(affinity_run.outputs) == PREFIXES * PER_PREFIX
    for request_id, reference in stock_run.outputs.items():
        assert_same_greedy_path(reference, affinity_run.outputs[request_id], request_id)


def test_no_request_was_passed_over_more_than_max_skips_times(affinity_run):
    c = affinity_run.reorder
    assert c.admissions == PREFIXES * PER_PREFIX
    assert c.out_of_order > 0
    assert 0 < c.cached_prefix <= c.cached_blocks <= (PREFIX_TOKENS // 32) * c.cached_prefix
    assert c.max_skips <= MAX_SKIPS


def test_a_higher_priority_request_is_admitted_before_requests_whose_prefix_is_cached(affinity_llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine, rng = affinity_llm.llm_engine, random.Random(1)
    hot, cold = random_tokens(rng, PREFIX_TOKENS), random_tokens(rng, PREFIX_TOKENS)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    def add(name: str, prefix: list[int], priority: int) -> str:
        prompt = TokensPrompt(prompt_token_ids=prefix + random_tokens(rng, SUFFIX_TOKENS))
        return engine.add_request(name, prompt, params, priority=priority)

    add("warm", hot, priority=1)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(6):
        add(f"cached{i}", hot, priority=1)
    urgent = add("urgent", cold, priority=0)
    engine.step()
    running = [r.request_id for r in scheduler_of(affinity_llm).running]
    while engine.has_unfinished_requests():
        engine.step()
    assert running[0] == urgent and len(running) == ENGINE["max_num_seqs"]


def test_an_async_engine_gets_the_same_scheduler_on_vllms_async_base(affinity_llm):
    """The CPU backend never schedules asynchronously, so build the scheduler for an async config by hand."""
    import copy

    from vllm import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.request import Request

    from kvreuse.vllm.reorder.scheduler import AsyncPrefixAffinityScheduler, PrefixAffinityScheduler

    core = affinity_llm.llm_engine.engine_core.engine_core
    config = copy.copy(core.vllm_config)
    config.scheduler_config = copy.copy(config.scheduler_config)
    config.scheduler_config.async_scheduling = True
    scheduler = PrefixAffinityScheduler(
        vllm_config=config,
        kv_cache_config=core.scheduler.kv_cache_config,
        structured_output_manager=core.structured_output_manager,
        block_size=core.scheduler.block_size,
    )
    assert type(scheduler) is AsyncPrefixAffinityScheduler
    assert isinstance(scheduler, PrefixAffinityScheduler) and isinstance(scheduler, AsyncScheduler)

    rng = random.Random(2)
    prefixes = {p: random_tokens(rng, PREFIX_TOKENS) for p in "ABC"}
    for name in ["A0", "B0", "B1", "C0", "B2"]:
        scheduler.add_request(
            Request(
                name,
                prefixes[name[0]] + random_tokens(rng, SUFFIX_TOKENS),
                SamplingParams(max_tokens=1),
                None,
                block_hasher=core.request_block_hasher,
            )
        )
    admitted = [r.req_id for r in scheduler.schedule().scheduled_new_reqs]
    # The largest group of requests sharing an uncached prefix goes first; then arrival order.
    assert admitted == ["B0", "B1", "B2", "A0"]


def test_counters_reach_a_front_end_stat_logger_through_vllms_scheduler_stats(affinity_llm):
    """SchedulerStats cross from engine core to front end as msgpack; ReorderStatLogger exports what arrives.

    Runs last: ``make_stats`` hands over the engine's pending prefix-cache statistics.
    """
    from prometheus_client import REGISTRY
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from kvreuse.vllm.reorder.metrics import ReorderStatLogger, attach_reorder_counters

    scheduler = scheduler_of(affinity_llm)
    sent = EngineCoreOutputs(scheduler_stats=scheduler.make_stats())
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(sent)).scheduler_stats
    config = affinity_llm.llm_engine.vllm_config
    stat_logger = ReorderStatLogger(config, [0])
    stat_logger.record(received, None)
    stat_logger.record(received, None)  # counters are cumulative: the same totals again add nothing

    labels = {"model_name": config.model_config.served_model_name, "engine": "0"}
    counters = scheduler.reorder_counters()
    assert counters.admissions > 0
    assert REGISTRY.get_sample_value("kvreuse:reorder_admissions_total", labels) == counters.admissions
    assert REGISTRY.get_sample_value("kvreuse:reorder_out_of_order_total", labels) == counters.out_of_order
    assert REGISTRY.get_sample_value("kvreuse:reorder_most_skips", labels) == counters.max_skips
    assert REGISTRY.get_sample_value("kvreuse:reorder_max_skips", labels) == MAX_SKIPS  # the setting

    restarted = SchedulerStats()  # an engine core that started over reports smaller totals: they are new counts
    attach_reorder_counters(restarted, ReorderCounters(admissions=3))
    stat_logger.record(restarted, None)
    assert REGISTRY.get_sample_value("kvreuse:reorder_admissions_total", labels) == counters.admissions + 3
