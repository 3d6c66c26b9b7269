"""PML schemas and prompts for an engine whose prompt positions are contiguous (vLLM, SGLang).

Prompt Cache places a module at its schema positions and leaves gaps where unused modules would be. An engine
numbers a prompt's tokens 0, 1, 2, ... with no gaps, so here a prompt is the plain concatenation of its parts and
every cached run of tokens is moved to wherever it lands (``kvreuse.modules.splice``):

* :func:`schema_runs` lists what to encode: every maximal run of a schema's cached tokens at consecutive schema
  positions, named ``"<schema>:<module>#<k>"`` (``"<schema>:#<k>"`` for the scaffold). A ``<param>`` ends a run
  (its argument is not cached) and so does a nested module (it is a module of its own).
* :func:`prompt_token_ids` turns a resolved prompt into the engine's token ids: the scaffold's runs first, then the
  prompt's items in order; an imported module contributes its own runs with each param's argument in its place,
  and a nested import follows its parent's own text. The ids are the runs' ids exactly (each text run was
  tokenized alone), so the token trie finds every run without the boundary rules that plain text needs.

A union's members are alternatives: a prompt imports one, and it lands where the prompt puts it.
"""

from __future__ import annotations

from kvreuse.modules.layout import FreeText, Resolution, SchemaLayout, Segment


def _runs(segments: tuple[Segment, ...]) -> list[tuple[int, ...]]:
    runs: list[list[int]] = []
    end = None
    for seg in segments:
        if seg.kind == "param":
            end = None
            continue
        if end is None or seg.start != end:
            runs.append([])
        runs[-1].extend(seg.token_ids)
        end = seg.start + seg.length
    return [tuple(run) for run in runs if run]


def schema_runs(layout: SchemaLayout) -> dict[str, tuple[int, ...]]:
    """Name -> token ids of every cached run of ``layout`` (scaffold first, then modules in document order)."""
    out = {f"{layout.name}:#{k}": run for k, run in enumerate(_runs(layout.scaffold))}
    for name, span in layout.modules.items():
        out.update({f"{layout.name}:{name}#{k}": run for k, run in enumerate(_runs(span.segments))})
    return out


def prompt_token_ids(resolution: Resolution, layout: SchemaLayout) -> list[int]:
    """The token ids an engine gets for a resolved prompt (see the module docstring)."""
    ids = [t for seg in layout.scaffold if seg.kind != "param" for t in seg.token_ids]
    for item in resolution.items:
        if isinstance(item, FreeText):
            ids.extend(item.token_ids)
            continue
        for seg in layout.modules[item.name].segments:
            ids.extend(item.args.get(seg.name, ()) if seg.kind == "param" else seg.token_ids)
    return ids
