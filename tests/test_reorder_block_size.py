"""The block-size checks: a platform default larger than 32 tokens is named at start, and prompts mostly shorter than
one block are named once, with their figures, whoever chose the block size."""

from __future__ import annotations

from kvreuse.reorder.block_size import ROW_BLOCK_SIZE, SAMPLE, ShortPromptWatch, block_size_warning


def test_the_cpu_platforms_default_of_128_is_named_at_start_with_the_fix():
    warning = block_size_warning(128, chosen_by_user=False)
    assert warning is not None and "128 tokens" in warning and "--block-size 32" in warning


def test_a_block_size_the_user_chose_or_one_of_32_or_less_gets_no_start_warning():
    assert block_size_warning(128, chosen_by_user=True) is None
    assert block_size_warning(ROW_BLOCK_SIZE, chosen_by_user=False) is None
    assert block_size_warning(16, chosen_by_user=False) is None


def test_79_token_prompts_under_128_token_blocks_are_named_once_after_the_sample():
    watch = ShortPromptWatch(128)
    assert watch.observe([79] * (SAMPLE - 1)) is None  # not judged before the sample is complete
    warning = watch.observe([79, 79])
    assert warning is not None and f"{SAMPLE} of the first {SAMPLE} prompts" in warning and "median 79" in warning
    assert watch.done and watch.observe([79] * SAMPLE) is None  # once


def test_prompts_longer_than_a_block_or_only_a_minority_shorter_give_no_warning():
    assert ShortPromptWatch(32).observe([79] * SAMPLE) is None
    half_minus_one = SAMPLE // 2 - 1
    assert ShortPromptWatch(128).observe([79] * half_minus_one + [300] * (SAMPLE - half_minus_one)) is None


def test_exactly_half_shorter_than_a_block_is_named():
    assert ShortPromptWatch(128).observe([79] * (SAMPLE // 2) + [300] * (SAMPLE // 2)) is not None


def test_the_vllm_scheduler_feeds_its_newly_admitted_prompts_to_the_check(caplog):
    import logging
    from types import SimpleNamespace

    from kvreuse.vllm.reorder.scheduler import PrefixAffinityScheduler

    scheduler = object.__new__(PrefixAffinityScheduler)  # only the check's state: no engine
    scheduler._short_prompts = ShortPromptWatch(128)
    step = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(prompt_token_ids=[0] * 79) for _ in range(SAMPLE)])
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.kvreuse.scheduler"):
        scheduler._watch_prompt_lengths(step)
    assert any("shorter than one KV block of 128 tokens" in r.getMessage() for r in caplog.records)
