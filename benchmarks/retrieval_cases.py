"""Retrieval questions with known answers, for judging sparse attention on a real model.

Each case is a chat prompt: a haystack of real text (movie synopses and reviews from
``shared/datasets/movies_small.csv``, or ``$KVREUSE_DATASETS``, sentences in a random order per case) with facts
planted at random depths, then a question about one fact. Two kinds:

- ``needle``: one fact, "The secret number of Alice Moreau is 4821."; the question asks for it;
- ``multi``: three facts of the same form about three different people at three depths; the question asks about
  one of them, so the model must retrieve the right one among look-alikes.

The question comes before the document and again after it, and the reply is started for the model ("The secret
number of Alice Moreau is"), so that a 135M-parameter model answers with the number. The answer is a 4-digit
number; a case is answered correctly when that number is in the completion. Cases are deterministic in ``(kind,
tokens, index)``; ``tokens`` is the prompt length in tokens (within one sentence of it, never above).
"""

from __future__ import annotations

import csv
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvreuse.localmodel import DATASETS

FIRST = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kaori", "Lars")
LAST = ("Moreau", "Okafor", "Lindqvist", "Tanaka", "Ferreira", "Novak", "Haddad", "Brennan", "Castillo", "Weber")
MULTI_FACTS = 3
ANSWER = "The secret number of {who} is"  # the reply starts here: the completion is the number
INSTRUCTION = "Read the document and answer the question at the end with the number only."


@dataclass(frozen=True)
class RetrievalCase:
    """One question: ``prompt`` (chat-formatted text), ``answer`` (the number asked for), and where the facts
    are (character offsets of each planted fact in the prompt, the asked one first)."""

    kind: str
    tokens: int
    index: int
    prompt: str
    answer: str
    fact_offsets: tuple[int, ...]

    def correct(self, completion: str) -> bool:
        return self.answer in completion


@lru_cache(maxsize=1)
def filler_sentences(path: Path = DATASETS / "movies_small.csv") -> tuple[str, ...]:
    """Every sentence of the dataset's synopses and reviews, once, in file order."""
    seen: dict[str, None] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for text in (row["movie_info"], row["review_content"]):
                for sentence in text.replace("\n", " ").split(". "):
                    sentence = sentence.strip().rstrip(".")
                    if len(sentence) > 20:
                        seen.setdefault(sentence + ".", None)
    return tuple(seen)


def haystack_order(rng: random.Random, tokens: int) -> list[str]:
    """The filler sentences in ``rng``'s random order, then again in fresh orders as often as a ``tokens``-long
    prompt needs: the corpus is ~24K tokens of SmolLM2's tokenizer, so a 32K haystack reads some sentences twice,
    far apart (every planted fact is still unique). The later passes draw from their own generator, so ``rng``
    draws what it drew before there were passes, and a prompt within one pass is what it always was."""
    order = list(filler_sentences())
    rng.shuffle(order)
    again = random.Random(order[0])
    for _ in range(tokens // 20_000):  # a pass holds ~24K tokens
        more = list(filler_sentences())
        again.shuffle(more)
        order += more
    return order


def make_case(
    kind: str, tokens: int, index: int, count_tokens: Callable[[str], int], chat: Callable[[str], str]
) -> RetrievalCase:
    """Case ``index`` of ``kind`` at ``tokens`` prompt tokens. ``count_tokens`` counts a text's tokens, ``chat``
    wraps the user message in the model's chat template (with the generation prompt)."""
    if kind not in ("needle", "multi"):
        raise ValueError(f"kind must be 'needle' or 'multi', got {kind!r}")
    rng = random.Random(f"{kind}:{tokens}:{index}")
    count = MULTI_FACTS if kind == "multi" else 1
    people = [f"{a} {b}" for a, b in zip(rng.sample(FIRST, count), rng.sample(LAST, count))]
    codes = [str(rng.randrange(1000, 10_000)) for _ in people]
    facts = [f"The secret number of {who} is {code}." for who, code in zip(people, codes)]
    question = f"What is the secret number of {people[0]}?"
    sentences = haystack_order(rng, tokens)

    def message(body: str) -> str:
        return f"{question} {INSTRUCTION}\n\nDocument:\n{body}\n\nQuestion: {question}"

    overhead = count_tokens(chat(message(" ".join(facts))) + ANSWER.format(who=people[0]))
    budget = tokens - overhead
    haystack: list[str] = []
    used = 0
    for sentence in sentences:  # sentence tokens add up to within a few tokens of the joined text's
        cost = count_tokens(" " + sentence)
        if used + cost > budget:
            break
        haystack.append(sentence)
        used += cost
    depths = sorted(rng.sample(range(1, len(haystack)), len(facts)))
    order = list(range(len(facts)))
    rng.shuffle(order)  # which depth each fact goes to; the asked fact is facts[0]
    placed = dict(zip(depths, (facts[i] for i in order)))
    body = " ".join(s if i not in placed else f"{placed[i]} {s}" for i, s in enumerate(haystack))
    prompt = chat(message(body)) + ANSWER.format(who=people[0])
    offsets = tuple(prompt.index(fact) for fact in facts)
    return RetrievalCase(kind, tokens, index, prompt, codes[0], offsets)


def make_document_cases(
    tokens: int, facts: int, count_tokens: Callable[[str], int], chat: Callable[[str], str], seed: int = 0
) -> list[RetrievalCase]:
    """``facts`` needle questions about one shared document of about ``tokens`` tokens (kind ``document``): the
    document holds ``facts`` facts about different people at spread depths, and each case asks for one of them,
    the question after the document only. All the cases' prompts share the document as a prefix, so an engine's
    prefix cache prefills it once and each further question costs its own few tokens: how long-context needle
    questions fit a small CPU machine (a 32K prefill takes minutes there)."""
    rng = random.Random(f"document:{tokens}:{seed}")
    pairs = [(a, b) for a in FIRST for b in LAST]
    people = [f"{a} {b}" for a, b in rng.sample(pairs, facts)]
    codes = [str(rng.randrange(1000, 10_000)) for _ in people]
    lines = [f"The secret number of {who} is {code}." for who, code in zip(people, codes)]

    def message(body: str, who: str) -> str:
        return f"Document:\n{body}\n\nQuestion: What is the secret number of {who}? {INSTRUCTION}"

    overhead = max(count_tokens(chat(message(" ".join(lines), who)) + ANSWER.format(who=who)) for who in people)
    budget = tokens - overhead
    haystack: list[str] = []
    used = 0
    for sentence in haystack_order(rng, tokens):
        cost = count_tokens(" " + sentence)
        if used + cost > budget:
            break
        haystack.append(sentence)
        used += cost
    # fact i at depth (i + 1/2) / facts of the document, in a random order of people
    depths = {int((i + 0.5) * len(haystack) / facts): i for i in range(facts)}
    order = list(range(facts))
    rng.shuffle(order)
    body = " ".join(s if i not in depths else f"{lines[order[depths[i]]]} {s}" for i, s in enumerate(haystack))
    cases = []
    for index, (who, code, line) in enumerate(zip(people, codes, lines)):
        prompt = chat(message(body, who)) + ANSWER.format(who=who)
        cases.append(RetrievalCase("document", tokens, index, prompt, code, (prompt.index(line),)))
    return cases


def make_cases(tokens: int, count: int, tokenizer, kinds: Sequence[str] = ("needle", "multi")) -> list[RetrievalCase]:
    """``count`` cases at ``tokens`` tokens, alternating ``kinds``, for a Hugging Face ``tokenizer`` with a chat
    template."""

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(message: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )

    return [make_case(kinds[i % len(kinds)], tokens, i, count_tokens, chat) for i in range(count)]
