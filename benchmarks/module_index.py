"""Finding modules in prompts: the token index before and after its rework, side by side, without an engine.

Before: the trie walk ``ModuleTrie.find`` did before (a dict-per-node trie, walked from every start
position; :class:`PreviousTrie` below is that code, kept here as the baseline). After: ``kvreuse.modules.trie``
(an Aho-Corasick automaton over the reversed modules, compiled with numba). Cases:

* ``realistic``: 10,000 modules of 16-256 random token ids (vocabulary 49,152, SmolLM2's), and a 128K-token prompt
  made of registered modules and free text between them;
* ``adversarial``: the same modules plus one of ``7 ... 7 8`` (128K tokens) and prompts of 7s, the case a client
  can choose (O(n * L) for the walk: quadratic here, so it is timed at 2K-8K tokens only);
* ``churn``: the index after 10,000 one-at-a-time registrations with a look-up every 100, then 1,000 replacements
  (remove one module, add it back under a new name, look up): automata per look-up, seconds per change;
* ``tenant``: a look-up that also sees a tenant namespace of 100 modules.

Times are medians of repeated runs on a shared 2-core machine (other jobs run beside it): read them as ratios
between the two indexes measured in the same run. Memory is ``tracemalloc``'s count of what building each index
allocated. Usage: ``python benchmarks/module_index.py`` (prints a table, writes ``module_index.json`` and
``module_index.png`` into the harness's output folder).
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
from harness import bench_parser, new_figure, output_dir, write_results

from kvreuse.modules.trie import ModuleTrie

VOCAB = 49_152
MODULES = 10_000
PROMPT = 128 * 1024
SEVENS = 128 * 1024  # length of the adversarial module 7 ... 7 8
PREVIOUS_ADVERSARIAL = (2048, 4096, 8192)  # the walk is quadratic on this case: larger prompts take minutes
ADVERSARIAL = (2048, 8192, 32768, 131072)


class PreviousTrie:
    """The module trie before issue 19 (the baseline): longest match from every start, no removal, no bound."""

    class _Node:
        __slots__ = ("children", "name")

        def __init__(self):
            self.children: dict = {}
            self.name = None

    def __init__(self, modules=()):
        self._root = self._Node()
        for name, ids in modules:
            self.add(name, ids)

    def add(self, name: Hashable, token_ids: Sequence[int]) -> None:
        node = self._root
        for token in token_ids:
            node = node.children.setdefault(int(token), self._Node())
        node.name = name

    def find(self, token_ids: Sequence[int]) -> list[tuple[Hashable, int, int]]:
        found, root, n, i = [], self._root, len(token_ids), 0
        while i < n:
            node, j, best = root, i, None
            while j < n:
                node = node.children.get(token_ids[j])
                if node is None:
                    break
                j += 1
                if node.name is not None:
                    best = (node.name, j)
            if best is None:
                i += 1
            else:
                found.append((best[0], i, best[1]))
                i = best[1]
        return found


def median_s(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of this process (less inflated by other jobs on the machine)."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def timed(arm: str, run: Callable[[], object] | None, repeat: int, measure: bool = True) -> dict[str, float | None]:
    wall, cpu = median_s(run, repeat) if measure and run is not None else (None, None)
    return {f"{arm}_s": wall, f"{arm}_cpu_s": cpu}


def built(make: Callable[[], object]) -> tuple[object, float, int]:
    """The index, seconds to build it, bytes allocated while building it (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    index = make()
    seconds = time.perf_counter() - started
    allocated = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return index, seconds, allocated


def ready(index: ModuleTrie) -> ModuleTrie:
    index.find([1])  # applies the pending registrations: the automaton is built here
    return index


def workload(rng: np.random.Generator) -> tuple[list[tuple[int, list[int]]], list[int]]:
    modules = [(k, rng.integers(100, VOCAB, int(rng.integers(16, 257))).tolist()) for k in range(MODULES)]
    prompt: list[int] = []
    while len(prompt) < PROMPT:
        prompt += modules[int(rng.integers(MODULES))][1]
        prompt += rng.integers(100, VOCAB, int(rng.integers(0, 64))).tolist()
    return modules, prompt[:PROMPT]


def main(argv: list[str] | None = None) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    rng = np.random.default_rng(19)
    modules, prompt = workload(rng)
    tokens = sum(len(ids) for _, ids in modules)
    sevens = ("sevens", [7] * (SEVENS - 1) + [8])
    started = time.perf_counter()
    ModuleTrie([("warm", [1, 2])]).find([1, 2])  # numba compiles (or loads its cache) once per process
    compile_s = time.perf_counter() - started

    new, new_build_s, new_bytes = built(lambda: ready(ModuleTrie(modules + [sevens])))
    old, old_build_s, old_bytes = built(lambda: PreviousTrie(modules + [sevens]))
    assert [(m.name, m.start, m.end) for m in new.find(prompt)] == old.find(prompt)

    rows = []
    rows.append(
        {
            "case": "realistic",
            "prompt_tokens": PROMPT,
            **timed("previous", lambda: old.find(prompt), 3),
            **timed("new", lambda: new.find(prompt), 7),
        }
    )
    for n in ADVERSARIAL:
        attack = [7] * n
        rows.append(
            {
                "case": "adversarial",
                "prompt_tokens": n,
                **timed("previous", lambda: old.find(attack), 1, n in PREVIOUS_ADVERSARIAL),  # noqa: B023
                **timed("new", lambda: new.find(attack), 7),  # noqa: B023
            }
        )
    tenant = ModuleTrie(modules)
    for k in range(100):
        tenant.add(("tenant", k), rng.integers(100, VOCAB, 128).tolist(), namespace="salt")
    tenant.find([1], namespace="salt")
    rows.append(
        {
            "case": "tenant",
            "prompt_tokens": PROMPT,
            **timed("previous", None, 0, False),
            **timed("new", lambda: tenant.find(prompt, namespace="salt"), 7),
        }
    )

    churn = ModuleTrie()
    started = time.perf_counter()
    for k, (name, ids) in enumerate(modules):
        churn.add(name, ids)
        if k % 100 == 99:
            churn.find(prompt[:1024])
    one_at_a_time_s = time.perf_counter() - started
    segments_after_adds = churn.segments()
    changes, worst, worst_cpu, segments = 1000, 0.0, 0.0, []
    started = time.perf_counter()
    for _ in range(changes):
        name, ids = modules[int(rng.integers(MODULES))]
        if churn.holds(name):
            churn.remove(name)
            churn.add(("v2", name), ids)
        change, change_cpu = time.perf_counter(), time.process_time()
        churn.find(prompt[:1024])
        worst = max(worst, time.perf_counter() - change)
        worst_cpu = max(worst_cpu, time.process_time() - change_cpu)
        segments.append(churn.segments())
    churn_s = time.perf_counter() - started
    rows.append(
        {
            "case": "churn",
            "prompt_tokens": PROMPT,
            **timed("previous", None, 0, False),
            **timed("new", lambda: churn.find(prompt), 7),
        }
    )

    figures = {
        "modules": MODULES + 1,
        "module_tokens": tokens + SEVENS,
        "numba_compile_or_cache_load_s": compile_s,
        "build_s": {"previous": old_build_s, "new": new_build_s},
        "build_bytes": {"previous": old_bytes, "new": new_bytes},
        "new_index_array_bytes": new.nbytes,
        "new_index_charged_bytes": new.charged_bytes,
        "churn": {
            "one_at_a_time_registration_s": one_at_a_time_s,
            "segments_after_10000_adds": segments_after_adds,
            "replacements": changes,
            "seconds_per_replacement": churn_s / changes,
            "worst_lookup_after_a_replacement_s": worst,
            "worst_lookup_after_a_replacement_cpu_s": worst_cpu,
            "most_segments": max(segments),
        },
        "rows": rows,
    }
    report(figures)
    write_results("module_index", figures, output_dir(args), plot(figures))


def report(figures: dict) -> None:
    print(f"{figures['modules']} modules, {figures['module_tokens']} tokens; ms = median wall (median CPU)")
    print("| case | prompt tokens | previous ms | new ms | speed-up |\n| --- | ---: | ---: | ---: | ---: |")
    for row in figures["rows"]:
        prev, new = row["previous_s"], row["new_s"]
        speedup = f"{prev / new:.0f}x" if prev else "-"
        prev_ms = f"{1000 * prev:.1f} ({1000 * row['previous_cpu_s']:.1f})" if prev else "-"
        new_ms = f"{1000 * new:.2f} ({1000 * row['new_cpu_s']:.2f})"
        print(f"| {row['case']} | {row['prompt_tokens']} | {prev_ms} | {new_ms} | {speedup} |")
    build, mem = figures["build_s"], figures["build_bytes"]
    print(
        f"build: previous {build['previous']:.2f} s, {mem['previous'] / figures['module_tokens']:.0f} B/token; "
        f"new {build['new']:.2f} s, "
        f"{mem['new'] / figures['module_tokens']:.0f} B/token allocated, "
        f"{figures['new_index_array_bytes'] / figures['module_tokens']:.1f} B/token of arrays, "
        f"{figures['new_index_charged_bytes'] / figures['module_tokens']:.1f} B/token charged"
    )
    churn = figures["churn"]
    print(
        f"churn: 10,000 adds one at a time {churn['one_at_a_time_registration_s']:.1f} s "
        f"({churn['segments_after_10000_adds']} automata after); a replacement + look-up "
        f"{1000 * churn['seconds_per_replacement']:.1f} ms on average, the slowest look-up after one "
        f"{1000 * churn['worst_lookup_after_a_replacement_s']:.0f} ms "
        f"({1000 * churn['worst_lookup_after_a_replacement_cpu_s']:.0f} ms CPU), "
        f"at most {churn['most_segments']} automata"
    )
    print(f"numba compile (or cache load), once per process: {figures['numba_compile_or_cache_load_s']:.1f} s")


def plot(figures: dict) -> Any:
    rows = [r for r in figures["rows"] if r["case"] == "adversarial"]
    fig, ax = new_figure(figsize=(6, 4))
    prev = [(r["prompt_tokens"], r["previous_s"]) for r in rows if r["previous_s"]]
    ax.plot(*zip(*prev), "o-", label="previous trie walk")
    ax.plot([r["prompt_tokens"] for r in rows], [r["new_s"] for r in rows], "s-", label="Aho-Corasick index")
    ax.axhline(0.05, color="grey", linestyle=":", label="50 ms goal")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens (all 7s)",
        ylabel="find time (s)",
        title=f"Adversarial prompt, {figures['modules']:,} modules",
    )
    ax.legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
