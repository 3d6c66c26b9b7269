"""Find registered modules inside a plain prompt's token ids, for prompts that were not written in PML.

A :class:`ModuleTrie` holds the token ids of every registered module (a table's DDL, a document), per namespace
(:mod:`kvreuse.modules.namespace`). :meth:`ModuleTrie.find` returns, left to right, at each position the longest
module starting there (leftmost-longest), jumping past it, so the spans never overlap; a look-up for namespace
``S`` sees the global modules and those of ``S`` (equally long matches: ``S``'s wins).

Bounded and linear. Matching is an Aho-Corasick automaton over the reversed modules (:mod:`.automaton`): O(n)
in the prompt's length whatever the modules are (the previous trie walk was O(n * L) on a prompt of ``7 7 7 ...``
against a module ``7 ... 7 8``). Modules leave the index with :meth:`ModuleTrie.remove` (when their module leaves
the store or is replaced); a removed module's tokens may be registered again at once, under any name. The index
keeps within ``budget_bytes`` (``modules.index_bytes``): 32 bytes per registered token (at most 28 for the
automaton's arrays, 4 for the module's token ids kept to rebuild it) plus :data:`MODULE_BYTES` per module,
counted until the automaton holding a removed module is rebuilt; an :meth:`add` past the budget raises
:class:`ModuleIndexFull`.

Changes are cheap. A namespace's modules live in a few immutable automata (segments). Added modules wait in a
list and become a new segment at the next :meth:`find`; the newest segment is merged into the one before while
it is at least half its size, or the one before is small (under 16K tokens, a few milliseconds to rebuild), so a
namespace of N tokens has at most about log2(N / 16K) + 2 segments and each token is rebuilt O(log N) times.
A removal marks the module dead in its segment (O(1): look-ups skip it); a segment with
more dead tokens than live ones is rebuilt without them. Not thread-safe: one engine thread uses it.
The first index of a process compiles the automaton's functions (numba; about 1 s from its on-disk cache).

Token boundaries. A byte-level BPE tokenizer (the GPT-2 pre-tokenizer, as in the local model and Llama 3)
splits text into pieces before merging, and merges never cross a piece boundary. A newline followed by a
non-space character is always a boundary: the newline ends one piece and the character starts the next. So a
module's tokens are the same alone and inside a prompt when (see :func:`module_text`):

* the module starts with a non-whitespace character and ends with exactly one ``"\\n"``;
* the text before it is empty or ends with ``"\\n"``;
* the text after it is empty or starts with a non-whitespace character (``"\\n\\n"`` or ``"\\n "`` may merge
  into one token across the boundary).

``tests/test_modules_trie.py`` checks this with the local model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvreuse.errors import ModuleIndexFull, ModuleRegistrationError
from kvreuse.modules import automaton
from kvreuse.modules.config import ModulesConfig
from kvreuse.modules.namespace import GLOBAL, namespace_label

# A shorter module's all-but-last tokens appear by chance too often to say its boundary merged.
NEAR_MISS_MIN_TOKENS = 4
TOKEN_BYTES = automaton.NODE_BYTES + 4  # automaton nodes (at most one per token) and the kept token ids
MODULE_BYTES = 256  # per module: its entry, its name and token-id keys, its slot in a segment (an estimate)
MERGE_RATIO = 2  # the newest segment is merged into the previous one while it is at least 1/MERGE_RATIO of it
SMALL_SEGMENT = 16_384  # tokens: a previous segment smaller than this takes the newest in whatever their sizes


def module_text(text: str) -> str:
    """``text`` with the boundaries above: no leading or trailing whitespace, then one newline."""
    stripped = text.strip()
    if not stripped:
        raise ModuleRegistrationError("a module's text is empty or only whitespace")
    return stripped + "\n"


@dataclass(frozen=True)
class ModuleMatch:
    """Module ``name`` occupies tokens ``[start, end)`` of the prompt."""

    name: Hashable
    start: int
    end: int


@dataclass(eq=False)
class _Entry:
    name: Hashable
    namespace: str
    ids: np.ndarray  # int32 token ids
    slot: int  # its id in ModuleTrie._entries, which the automata report
    segment: _Segment | None = None  # None while waiting for the next find
    local: int = -1  # the module's id inside its segment
    removed: bool = False

    @property
    def charge(self) -> int:
        return TOKEN_BYTES * len(self.ids) + MODULE_BYTES


@dataclass(eq=False)
class _Segment:
    """One immutable automaton over some modules of a namespace; modules only die in it."""

    entries: list[_Entry]
    first: np.ndarray
    labels: np.ndarray
    children: np.ndarray
    fail: np.ndarray
    term: np.ndarray
    term_node: np.ndarray
    root: np.ndarray
    lengths: np.ndarray
    slots: np.ndarray  # local module id -> the entry's slot
    out: np.ndarray = field(init=False)
    live: int = 0  # tokens of live modules
    dead: int = 0  # tokens of removed modules still in the arrays

    def __post_init__(self) -> None:
        self.out = automaton.outputs(self.fail, self.term)
        self.live = int(self.lengths.sum())

    @property
    def nbytes(self) -> int:
        arrays = (self.first, self.labels, self.children, self.fail, self.term, self.out, self.root, self.term_node)
        return sum(a.nbytes for a in arrays) + self.lengths.nbytes + self.slots.nbytes


@dataclass
class _Namespace:
    segments: list[_Segment] = field(default_factory=list)
    pending: list[_Entry] = field(default_factory=list)
    by_name: dict[Hashable, _Entry] = field(default_factory=dict)
    by_tokens: dict[bytes, _Entry] = field(default_factory=dict)


class ModuleTrie:
    """Registered modules' token ids per namespace; :meth:`find` gives non-overlapping leftmost-longest matches."""

    def __init__(
        self,
        modules: Iterable[tuple[Hashable, Sequence[int]]] = (),
        *,
        budget_bytes: int = ModulesConfig.index_bytes,
        near_misses: bool = True,
    ):
        automaton.warm_up()
        self.budget_bytes = int(budget_bytes)
        self._spaces: dict[str, _Namespace] = {}
        self._entries: dict[int, _Entry] = {}  # slot -> live entry, for the automata's results
        self._next_slot = 0
        self._charged = 0  # bytes counted against the budget (live modules, and dead ones not yet rebuilt away)
        # Stems (all tokens but the last) of modules of NEAR_MISS_MIN_TOKENS or more, for near_misses: an index of
        # its own, named by the stem's bytes (modules may share a stem), and the modules ending each stem with
        # their last token. The stems count against a budget of their own, as large as this one's.
        self._stems = ModuleTrie(budget_bytes=budget_bytes, near_misses=False) if near_misses else None
        self._stem_ends: dict[tuple[str, bytes], dict[Hashable, int]] = {}
        for name, ids in modules:
            self.add(name, ids)

    # ---------------------------------------------------------------- public
    def __len__(self) -> int:
        return sum(len(space.by_name) for space in self._spaces.values())

    def __contains__(self, name: Hashable) -> bool:
        """Whether ``name`` is registered in the global namespace (:meth:`holds` for another)."""
        return self.holds(name)

    def holds(self, name: Hashable, namespace: str = GLOBAL) -> bool:
        space = self._spaces.get(namespace)
        return space is not None and name in space.by_name

    @property
    def charged_bytes(self) -> int:
        """Bytes counted against ``budget_bytes`` now."""
        return self._charged

    @property
    def nbytes(self) -> int:
        """Bytes of the automata's arrays and the kept token ids (no Python object overhead)."""
        arrays = sum(seg.nbytes for space in self._spaces.values() for seg in space.segments)
        return arrays + sum(entry.ids.nbytes for entry in self._entries.values())

    def add(self, name: Hashable, token_ids: Sequence[int] | np.ndarray, *, namespace: str = GLOBAL) -> None:
        """Register module ``name`` in ``namespace``; adding the same name with the same ids again does nothing.

        Raises :class:`ModuleRegistrationError` for empty or out-of-range ids, a name registered with other ids,
        or ids registered under another name in the same namespace, and :class:`ModuleIndexFull` past the budget.
        """
        ids = _token_array(name, token_ids)
        key = ids.tobytes()
        space = self._spaces.get(namespace)
        if space is not None:
            known = space.by_name.get(name)
            if known is not None:
                if known.ids.tobytes() == key:
                    return
                raise ModuleRegistrationError(
                    f"module {name!r} is already registered with other token ids in namespace "
                    f"{namespace_label(namespace)}; remove it first"
                )
            twin = space.by_tokens.get(key)
            if twin is not None:
                raise ModuleRegistrationError(
                    f"modules {twin.name!r} and {name!r} have the same token ids in namespace "
                    f"{namespace_label(namespace)}"
                )
        entry = _Entry(name, namespace, ids, self._next_slot)
        if self._charged + entry.charge > self.budget_bytes:
            self._compact()
            if self._charged + entry.charge > self.budget_bytes:
                raise ModuleIndexFull(
                    f"module {name!r} ({len(ids)} tokens, {entry.charge} bytes) does not fit the token index: "
                    f"{self._charged} of modules.index_bytes = {self.budget_bytes} bytes are used; raise "
                    f"modules.index_bytes (KVREUSE_MODULES_INDEX_BYTES) or drop modules"
                )
        space = self._spaces.setdefault(namespace, _Namespace())
        space.by_name[name] = entry
        space.by_tokens[key] = entry
        space.pending.append(entry)
        self._entries[entry.slot] = entry
        self._next_slot += 1
        self._charged += entry.charge
        self._add_stem(entry)

    def remove(self, name: Hashable, *, namespace: str = GLOBAL) -> bool:
        """Unregister ``name`` from ``namespace``; whether it was registered. Its tokens are free at once."""
        space = self._spaces.get(namespace)
        if space is None:
            return False
        entry = space.by_name.pop(name, None)
        if entry is None:
            return False
        del space.by_tokens[entry.ids.tobytes()]
        del self._entries[entry.slot]
        entry.removed = True
        self._remove_stem(entry)
        segment = entry.segment
        if segment is None:
            space.pending.remove(entry)
            self._charged -= entry.charge
        else:
            segment.term[segment.term_node[entry.local]] = -1
            segment.live -= len(entry.ids)
            segment.dead += len(entry.ids)  # its charge stays until the segment is rebuilt
        if not space.by_name:
            self._drop_namespace(namespace)
        return True

    def find(self, token_ids: Sequence[int], *, namespace: str = GLOBAL) -> list[ModuleMatch]:
        """Modules of the global namespace and of ``namespace`` in ``token_ids``: left to right, the longest at
        each start, never overlapping."""
        spaces = [self._spaces[ns] for ns in dict.fromkeys((namespace, GLOBAL)) if ns in self._spaces]
        if not spaces or not len(token_ids):
            return []
        prompt = np.asarray(token_ids, dtype=np.int64)
        best_len = np.zeros(len(prompt), np.int32)
        best_slot = np.full(len(prompt), -1, np.int32)
        for space in spaces:  # the tenant's first: equally long matches stay with it
            for segment in self._ready(space):
                automaton.longest_at(
                    segment.first,
                    segment.labels,
                    segment.children,
                    segment.fail,
                    segment.term,
                    segment.term_node,
                    segment.out,
                    segment.root,
                    segment.lengths,
                    segment.slots,
                    prompt,
                    best_len,
                    best_slot,
                )
        starts, lengths, slots = automaton.select(best_len, best_slot)
        return [
            ModuleMatch(self._entries[slot].name, start, start + length)
            for start, length, slot in zip(starts.tolist(), lengths.tolist(), slots.tolist())
        ]

    def near_misses(
        self, token_ids: Sequence[int], found: Sequence[ModuleMatch] = (), *, namespace: str = GLOBAL
    ) -> list[ModuleMatch]:
        """Modules of at least :data:`NEAR_MISS_MIN_TOKENS` tokens whose tokens all but the last appear in
        ``token_ids`` where no module of ``found`` (what :meth:`find` returned) lies, followed by another token:
        the text after such a module merged with its last token (e.g. ``"\\n\\n"`` into one token), so the module
        cannot be found. The span given is the part that matched. Linear in the prompt, like :meth:`find`."""
        if self._stems is None or not len(token_ids):
            return []
        covered = np.zeros(len(token_ids) + 1, dtype=bool)
        for match in found:
            covered[match.start : match.end] = True
        misses = []
        for stem in self._stems.find(token_ids, namespace=namespace):
            if covered[stem.start : stem.end].any():
                continue
            stem_key = stem.name
            assert isinstance(stem_key, bytes)  # the stem index names each stem by its ids' bytes (_add_stem)
            ends = self._stem_ends.get((namespace, stem_key)) or self._stem_ends[(GLOBAL, stem_key)]
            after = int(token_ids[stem.end]) if stem.end < len(token_ids) else None
            if after is None or after in ends.values():
                continue  # the prompt ends there, or the whole module is there
            misses.append(ModuleMatch(next(iter(ends)), stem.start, stem.end))
        return misses

    def segments(self, namespace: str = GLOBAL) -> int:
        """Automata a look-up in ``namespace`` alone scans now (after pending changes are applied)."""
        space = self._spaces.get(namespace)
        return 0 if space is None else len(self._ready(space))

    # --------------------------------------------------------------- private
    def _ready(self, space: _Namespace, *, compact: bool = False) -> list[_Segment]:
        """Apply pending changes: new modules become a segment, mostly dead segments are rebuilt (every segment
        with a dead module when ``compact``), the newest segments merge."""
        if space.pending:
            space.segments.append(self._build(space.pending))
            space.pending = []
        kept = []
        for segment in space.segments:
            if segment.dead and (compact or segment.dead > segment.live):
                self._release(segment)
                live = [e for e in segment.entries if not e.removed]
                if live:
                    kept.append(self._build(live))
            else:
                kept.append(segment)
        space.segments = kept
        while len(space.segments) >= 2 and (
            space.segments[-1].live * MERGE_RATIO >= space.segments[-2].live or space.segments[-2].live < SMALL_SEGMENT
        ):
            newer, older = space.segments.pop(), space.segments.pop()
            self._release(older)
            self._release(newer)
            space.segments.append(self._build([e for seg in (older, newer) for e in seg.entries if not e.removed]))
        return space.segments

    def _release(self, segment: _Segment) -> None:
        """Uncount the removed modules of a segment that is being rebuilt or dropped."""
        self._charged -= sum(e.charge for e in segment.entries if e.removed)

    def _build(self, entries: list[_Entry]) -> _Segment:
        entries = sorted(entries, key=lambda e: e.ids[::-1].tolist())
        reversed_ids = [e.ids[::-1] for e in entries]
        offsets = np.zeros(len(entries) + 1, np.int64)
        np.cumsum([len(r) for r in reversed_ids], out=offsets[1:])
        first, labels, children, fail, term, term_node, root = automaton.build(np.concatenate(reversed_ids), offsets)
        segment = _Segment(
            entries,
            first=first,
            labels=labels,
            children=children,
            fail=fail,
            term=term,
            term_node=term_node,
            root=root,
            lengths=np.diff(offsets).astype(np.int32),
            slots=np.array([e.slot for e in entries], np.int32),
        )
        for local, entry in enumerate(entries):
            entry.segment, entry.local = segment, local
        return segment

    def _add_stem(self, entry: _Entry) -> None:
        if self._stems is None or len(entry.ids) < NEAR_MISS_MIN_TOKENS:
            return
        stem = entry.ids[:-1]
        ends = self._stem_ends.setdefault((entry.namespace, stem.tobytes()), {})
        if not ends:
            try:
                self._stems.add(stem.tobytes(), stem, namespace=entry.namespace)
            except ModuleIndexFull:  # near misses are a diagnosis; the module itself is indexed
                del self._stem_ends[(entry.namespace, stem.tobytes())]
                return
        ends[entry.name] = int(entry.ids[-1])

    def _remove_stem(self, entry: _Entry) -> None:
        if self._stems is None or len(entry.ids) < NEAR_MISS_MIN_TOKENS:
            return
        key = (entry.namespace, entry.ids[:-1].tobytes())
        ends = self._stem_ends.get(key)
        if ends is None or ends.pop(entry.name, None) is None or ends:
            return
        del self._stem_ends[key]
        self._stems.remove(key[1], namespace=entry.namespace)

    def _compact(self) -> None:
        """Rebuild every segment that holds removed modules, so their bytes leave the budget."""
        for space in self._spaces.values():
            self._ready(space, compact=True)

    def _drop_namespace(self, namespace: str) -> None:
        for segment in self._spaces.pop(namespace).segments:
            self._release(segment)


def _token_array(name: Hashable, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    if not len(token_ids):
        raise ModuleRegistrationError(f"module {name!r} has no tokens")
    try:
        ids = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError):
        ids = np.asarray([0.5])  # refused below
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() > automaton.MAX_TOKEN_ID:
        raise ModuleRegistrationError(
            f"module {name!r}: token ids must be a flat list of integers in 0..{automaton.MAX_TOKEN_ID}"
        )
    return ids.astype(np.int32)
