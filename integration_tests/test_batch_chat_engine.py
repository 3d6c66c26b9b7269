"""Chat prompts, the front ends' default, on the real trained model (SmolLM2-135M-Instruct, which has a chat
template): each row is the user turn of a chat rendered as vLLM's own chat API renders it, and the instruct model
answers the question instead of continuing the record; the default order keeps every answer of the original
order.
"""

from __future__ import annotations

import pandas as pd
import pytest
from real_engine import start_llm, stop_llm

from kvreuse.batch import plan_table, run_table
from kvreuse.vllm.backend import VLLMBackend

pytestmark = pytest.mark.engine

ROWS = 16
QUESTION = "Which region does this car come from: USA, Europe or Japan? Answer with one word."
REGIONS = ("usa", "europe", "japan")


@pytest.fixture(scope="module")
def chat_llm(smollm2_model):
    engine = start_llm(smollm2_model)
    yield engine
    stop_llm(engine)


@pytest.fixture(scope="module")
def cars() -> pd.DataFrame:
    from vega_datasets import data

    return data.cars().sample(n=ROWS, random_state=0).reset_index(drop=True)


def test_chat_prompts_are_the_token_ids_vllms_chat_api_sends(chat_llm, cars):
    from vllm import SamplingParams

    backend = VLLMBackend(chat_llm)
    assert backend.chat  # the model has a chat template
    plan = plan_table(cars, QUESTION, ["Name", "Origin"], order="original")
    chats = [[{"role": "user", "content": prompt}] for prompt in plan.prompts[:4]]
    reference = chat_llm.chat(chats, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [backend._request(p)["prompt_token_ids"] for p in plan.prompts[:4]] == [
        list(out.prompt_token_ids) for out in reference
    ]


def test_planning_counts_the_chat_templates_preamble_as_a_shared_prefix(chat_llm):
    backend = VLLMBackend(chat_llm)
    head = backend.cache_model.prefix
    assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_start|>user\n")


def test_plans_replay_through_a_cache_of_the_engines_size(chat_llm):
    # local_engine_args gives 256 MiB of KV cache; SmolLM2 keeps 30 layers x 3 KV heads x 64 x 2 float32 a token
    blocks = (256 << 20) // (30 * 3 * 64 * 2 * 4 * 32)
    assert VLLMBackend(chat_llm).cache_model.capacity_blocks == blocks == 182


def test_with_chat_the_model_answers_the_question_where_raw_text_continues_the_record(chat_llm, cars):
    fields = [c for c in cars.columns if c != "Origin"]
    correct = {}
    for chat in (True, False):
        chat_llm.reset_prefix_cache()
        answers = run_table(cars, QUESTION, fields, backend=VLLMBackend(chat_llm, chat=chat), max_tokens=8).answers
        named = [next((r for r in REGIONS if r in a.lower()), None) for a in answers]
        correct[chat] = sum(n == origin.lower() for n, origin in zip(named, cars["Origin"]))
    assert correct[True] >= ROWS // 2 and correct[False] < correct[True], correct


def test_the_default_order_gives_every_row_the_original_orders_answer(chat_llm, cars):
    fields = ["Name", "Origin", "Cylinders", "Year"]
    answers = {}
    for order in ("original", "ggr"):
        chat_llm.reset_prefix_cache()
        result = run_table(
            cars, "Describe this car in one sentence.", fields, backend=VLLMBackend(chat_llm), order=order
        )
        answers[order] = result.answers.tolist()
    assert answers["ggr"] == answers["original"]


def test_calibration_on_the_real_model_keeps_a_field_order_whose_sample_answers_are_identical(chat_llm, cars):
    chat_llm.reset_prefix_cache()
    fields = ["Name", "Origin", "Cylinders", "Year", "Horsepower"]
    result = run_table(cars, QUESTION, fields, backend=VLLMBackend(chat_llm), calibrate=6, max_tokens=8)
    calibration = result.calibration
    print(calibration.table())  # the figures, for the report (pytest -s)
    assert [c.field_order for c in calibration.candidates] == ["keep", "global", "free"]
    assert calibration.candidate("keep").exact == 1.0 and calibration.units == "tokens"
    assert calibration.candidate(calibration.chosen).exact == 1.0  # the floor: identical answers
    assert calibration.candidate(calibration.chosen).reuse == max(
        c.reuse for c in calibration.candidates if c.exact == 1.0
    )
