"""What a job's order saved against the table's own order: the engine's count of the job beside the plan of the
table's own order, the plan's error on the job shown, and a field order named where it plans far less."""

from __future__ import annotations

from kvreuse.batch.backend import PrefixCacheModel
from kvreuse.batch.calibrate import planned_stats
from kvreuse.batch.savings import PrefillReport, field_order_advice
from kvreuse.reorder import BlockHitStats


def characters(texts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in text] for text in texts]


def test_planned_prefill_replays_the_prompts_through_a_cache_of_the_engines_size():
    rows = [f"row {k}: " + "x" * 25 for k in (1, 2, 3)]  # 32 characters each: 4 blocks of 8

    unbounded = planned_stats(rows * 2, PrefixCacheModel(characters, block_size=8))
    small = planned_stats(rows * 2, PrefixCacheModel(characters, block_size=8, capacity_blocks=4))
    # unbounded, each row asked again reuses 3 blocks (its last is recomputed); a cache of one row's blocks has
    # evicted a row by the time it comes again
    assert unbounded.computed_tokens == 6 * 32 - 3 * 24
    assert small.computed_tokens == 6 * 32


def test_planned_prefill_counts_the_chat_templates_text_after_the_users_turn_as_sent():
    """The text after a row (the end of its turn, the assistant's header) is part of every prompt the engine gets:
    it moves where the last full block ends. Three rows of 14 characters and a tail of 3: 17 each, two full blocks
    of 8, of which the second is shared only with the tail counted."""
    rows = ["same prefix. " + k for k in "abc"]  # 14 characters each, sharing the first 12
    without = planned_stats(rows, PrefixCacheModel(characters, block_size=8))
    framed = planned_stats(rows, PrefixCacheModel(characters, block_size=8, suffix="END"))
    assert (without.prompt_tokens, framed.prompt_tokens) == (3 * 14, 3 * 17)
    assert framed.hit_tokens == 2 * 8  # block 1 (characters 0-7) hit by rows 2 and 3; block 2 differs by row
    assert without.hit_tokens == 2 * 8


def test_the_frame_is_what_the_engine_gets_token_for_token():
    model = PrefixCacheModel(characters, block_size=8, prefix="<s>user\n", suffix="</s>\n<s>assistant\n")
    assert model.sent_tokens(["Q"]) == characters(["<s>user\nQ</s>\n<s>assistant\n"])


def report(counted_computed: int, planned: int, original: int, units: str = "tokens") -> PrefillReport:
    prompt = 10_000
    return PrefillReport(
        prompt,
        prompt - counted_computed,
        BlockHitStats(prompt, prompt - planned, planned),
        BlockHitStats(prompt, prompt - original, original),
        units,
    )


def test_the_summary_gives_the_engines_count_then_the_original_orders_plan_with_the_plans_error_on_this_job():
    first, against = report(counted_computed=4_000, planned=3_800, original=7_600).lines(original_order=False)
    assert first == (
        "prefill        4,000 of 10,000 prompt tokens computed, 6,000 served from the prefix cache (60.0%): "
        "the engine's count"
    )
    assert against == (
        "against        7,600 tokens computed in the table's own order, planned (2.00x this job's plan of 3,800; "
        "that plan is 5.0% under the engine's count)"
    )


def test_a_job_in_the_tables_own_order_is_compared_with_nothing():
    lines = report(4_000, 4_000, 4_000).lines(original_order=True)
    assert lines[1] == "against        nothing: this job was sent in the table's own order"


def test_a_server_that_reports_no_hits_is_said_so_and_characters_are_compared_as_a_ratio():
    silent = PrefillReport(None, None, BlockHitStats(100, 50, 50), BlockHitStats(100, 0, 100), "characters")
    first, against = silent.lines(original_order=False)
    assert first.startswith("prefill        not counted: ") and "--enable-prompt-tokens-details" in first
    assert silent.plan_error() is None
    assert against == (
        "against        the table's own order computes 2.00x the prompt characters of this job's order, planned on "
        "characters (the server's tokenizer is unknown)"
    )


def test_a_field_order_is_named_only_where_it_plans_at_most_four_fifths_of_the_jobs_prefill():
    job = BlockHitStats(1_000, 200, 800)
    close = {"global": BlockHitStats(1_000, 300, 700), "free": BlockHitStats(1_000, 340, 660)}
    assert field_order_advice(job, close, "tokens") is None  # 660 > 0.8 x 800
    far = {"global": BlockHitStats(1_000, 300, 700), "free": BlockHitStats(1_000, 800, 200)}
    line = field_order_advice(job, far, "tokens")
    assert line is not None
    assert line.startswith("field order    --field-order free would compute 200 prompt tokens, planned, against this ")
    assert "(4.0x fewer)" in line and "--calibrate" in line
