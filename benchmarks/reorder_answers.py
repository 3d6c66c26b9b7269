"""What reordering does to answers, on the real trained model: per-row agreement with the original order.

vega_datasets' cars (406 rows x 9 fields, a unique ``Name``), SmolLM2-135M-Instruct (``build/models/smollm2``,
float32, greedy) on vLLM's CPU engine, prompts sent raw as the batch front ends send them. Two questions:
``describe`` ("Describe this car in one sentence."; scored by whether the answer names the row's car: its
first two words) and ``origin`` (a known answer: the row's ``Origin``). Orders, each through ``plan_table`` with
the engine's tokenizer and block size, as ``llm_map`` plans them:

* ``original``: rows and fields as the table gives them (the reference);
* ``ggr``: ``field_order="free"``, rows and per-row field orders reordered;
* ``ggr pin=Name``: ``field_order="free"`` with ``pin=["Name"]``, which keeps the name first;
* ``rows only``: the front ends' default (``field_order="keep"``): every prompt is the original one and only
  the send order changes.

Per row: the answer equals the original order's, or not; where not, whether the prompt itself changed (fields
moved) or only the batch around it. A row whose prompt is unchanged is asked again alone: if alone it gives the
original answer, the difference came from batching (a different batch changes the float sums of the kernels), not
from the prompt. Also the hit rate vLLM reports and the generation time. Usage:
``python benchmarks/reorder_answers.py [--rows N] [--questions describe,origin] [--chat]`` (``--rows``: a random
sample of N rows, for a loaded machine; default all 406). ``--chat`` wraps every planned prompt in the model's
chat template (one user message, then the assistant's turn), as a user of an instruct model behind a chat
endpoint would send it; without it prompts go raw, as the batch front ends send them, and an instruct model
often continues the record instead of answering.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from harness import REPO, bench_parser, engine, output_dir, write_results

MODEL = REPO / "build" / "models" / "smollm2"
QUESTIONS = {
    "describe": ("Describe this car in one sentence.", 24),
    "origin": ("Which region does this car come from: USA, Europe or Japan? Answer with one word.", 12),
}
ARMS = {
    "original": dict(order="original"),
    "ggr": dict(order="ggr", field_order="free"),
    "ggr pin=Name": dict(pin=["Name"], field_order="free"),
    "rows only": dict(order="ggr"),  # the front ends' default, field_order="keep"
}


def score(question: str, answer: str, row: dict) -> bool:
    if question == "describe":
        return " ".join(str(row["Name"]).lower().split()[:2]) in answer.lower()
    return str(row["Origin"]).lower() in answer.lower()


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--questions", default=",".join(QUESTIONS))
    parser.add_argument("--chat", action="store_true")
    args = parser.parse_args(argv)
    from vega_datasets import data

    from kvreuse.batch.job import plan_table, run_plans
    from kvreuse.vllm.backend import VLLMBackend

    cars = data.cars()
    if args.rows is not None:
        cars = cars.sample(n=args.rows, random_state=0).reset_index(drop=True)
    rows = cars.to_dict("records")
    n = len(rows)
    report = []
    with engine(MODEL) as llm:
        backend = VLLMBackend(llm)
        tokenizer = llm.get_tokenizer()

        def chat(prompt: str) -> str:
            message = [{"role": "user", "content": prompt}]
            return tokenizer.apply_chat_template(message, tokenize=False, add_generation_prompt=True)

        backend.generate(["warm-up"], max_tokens=2)
        for question in args.questions.split(","):
            instruction, max_tokens = QUESTIONS[question]
            answers, prompts_by_arm = {}, {}
            for arm, options in ARMS.items():
                plan = plan_table(cars, instruction, cache_model=backend.cache_model, **options)
                if args.chat:
                    plan = replace(plan, prompts=[chat(p) for p in plan.prompts])
                llm.reset_prefix_cache()
                start = time.perf_counter()
                (completions,), figures = run_plans([plan], backend, max_tokens=max_tokens)
                seconds = time.perf_counter() - start
                answers[arm] = [c.text for c in completions]
                prompts_by_arm[arm] = dict(zip(plan.rows.tolist(), plan.prompts))
                entry = dict(
                    question=question,
                    arm=arm,
                    hit_rate=figures.hit_rate,
                    generate_s=seconds,
                    plan_s=plan.solve_s,
                    correct=sum(score(question, a, r) for a, r in zip(answers[arm], rows)),
                    examples=answers[arm][:3],
                )
                if arm != "original":
                    changed = [i for i in range(len(rows)) if answers[arm][i] != answers["original"][i]]
                    same_prompt = [i for i in changed if prompts_by_arm[arm][i] == prompts_by_arm["original"][i]]
                    alone = backend.generate(
                        [prompts_by_arm["original"][i] for i in same_prompt], max_tokens=max_tokens
                    )
                    entry.update(
                        identical=len(rows) - len(changed),
                        differ_prompt_changed=len(changed) - len(same_prompt),
                        differ_same_prompt=len(same_prompt),
                        same_prompt_alone_gives_original=sum(
                            a.text == answers["original"][i] for a, i in zip(alone, same_prompt)
                        ),
                        differ_correct_to_wrong=sum(
                            score(question, answers["original"][i], rows[i])
                            and not score(question, answers[arm][i], rows[i])
                            for i in changed
                        ),
                        differ_wrong_to_correct=sum(
                            not score(question, answers["original"][i], rows[i])
                            and score(question, answers[arm][i], rows[i])
                            for i in changed
                        ),
                    )
                report.append(entry)
                print(json.dumps(entry), flush=True)
    name = "reorder_answers_chat" if args.chat else "reorder_answers"
    write_results(name, {"settings": vars(args), "rows": report}, output_dir(args))
    print(f"\n{'question':9} {'arm':13} {'hit':>6} {'correct':>8} {'same':>5} {'prompt moved':>13} {'batch only':>11}")
    for e in report:
        print(
            f"{e['question']:9} {e['arm']:13} {e['hit_rate']:6.1%} {e['correct']:>4}/{n} "
            f"{e.get('identical', n):>5} {e.get('differ_prompt_changed', 0):>13} {e.get('differ_same_prompt', 0):>11}"
        )


if __name__ == "__main__":
    main()
