"""Find registered modules inside a plain prompt's token ids, for prompts that were not written in PML.

A :class:`ModuleTrie` holds the token ids of every registered module (a table's DDL, a document) in one trie
whose root is the index of first tokens. :meth:`ModuleTrie.find` scans the prompt left to right; at each
position it walks the trie as far as the prompt matches and keeps the longest module that ends on the way
(leftmost-longest); on a match it jumps past the module, so the spans it returns never overlap.

Complexity, honestly: the scan does at most ``d`` trie steps per start position, where ``d`` is how far the
prompt agrees with some module from there (at most the longest module's length ``L``). That is O(n) for a fixed
set of modules, O(n * L) in the worst case (a prompt like ``a a a a ...`` against a module ``a a ... a b``);
on real prompts most positions fail on the first token (one dict look-up) and matched spans are skipped whole,
so it is close to n steps. Aho-Corasick would bound it at O(n + L) but reports longest matches by end position,
not the leftmost-longest choice wanted here.

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
from dataclasses import dataclass

from kvreuse.errors import ModuleRegistrationError


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


# A shorter module's all-but-last tokens appear by chance too often to say its boundary merged.
NEAR_MISS_MIN_TOKENS = 4


class _Node:
    __slots__ = ("children", "name")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.name: Hashable | None = None  # the module that ends here, if any


class ModuleTrie:
    """Token trie over registered modules; :meth:`find` returns non-overlapping leftmost-longest matches."""

    def __init__(self, modules: Iterable[tuple[Hashable, Sequence[int]]] = ()):
        self._root = _Node()
        self._lengths: dict[Hashable, int] = {}
        for name, ids in modules:
            self.add(name, ids)

    def __len__(self) -> int:
        return len(self._lengths)

    def __contains__(self, name: Hashable) -> bool:
        return name in self._lengths

    def add(self, name: Hashable, token_ids: Sequence[int]) -> None:
        """Register module ``name``; adding the same name with the same ids again does nothing."""
        if not token_ids:
            raise ModuleRegistrationError(f"module {name!r} has no tokens")
        if name in self._lengths and self._lengths[name] != len(token_ids):
            raise ModuleRegistrationError(f"module {name!r} is already registered with other token ids")
        node = self._root
        for token in token_ids:
            node = node.children.setdefault(int(token), _Node())
        if node.name is not None and node.name != name:
            raise ModuleRegistrationError(f"modules {node.name!r} and {name!r} have the same token ids")
        if name in self._lengths and node.name != name:
            raise ModuleRegistrationError(f"module {name!r} is already registered with other token ids")
        node.name = name
        self._lengths[name] = len(token_ids)

    def find(self, token_ids: Sequence[int]) -> list[ModuleMatch]:
        """Registered modules in ``token_ids``, left to right, longest at each start, never overlapping."""
        found: list[ModuleMatch] = []
        root, n, i = self._root, len(token_ids), 0
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
                found.append(ModuleMatch(best[0], i, best[1]))
                i = best[1]
        return found

    def near_misses(self, token_ids: Sequence[int], found: Sequence[ModuleMatch] = ()) -> list[ModuleMatch]:
        """Modules of at least :data:`NEAR_MISS_MIN_TOKENS` tokens whose tokens all but the last appear in
        ``token_ids`` where no module of ``found`` (what :meth:`find` returned) lies: the text after such a module
        merged with its last token (e.g. ``"\n\n"`` into one token), so the module cannot be found. The span
        given is the part that matched."""
        covered = [False] * len(token_ids)
        for match in found:
            covered[match.start : match.end] = [True] * (match.end - match.start)
        misses: list[ModuleMatch] = []
        n, i = len(token_ids), 0
        while i < n:
            node, j, miss = self._root, i, None
            while j < n and not covered[j]:
                if j - i + 1 >= NEAR_MISS_MIN_TOKENS:  # deep in the trie, where nodes have few children
                    for token, child in node.children.items():
                        if child.name is not None and token != token_ids[j]:
                            miss = ModuleMatch(child.name, i, j)
                node = node.children.get(token_ids[j])
                if node is None:
                    break
                j += 1
            if miss is None:
                i += 1
            else:
                misses.append(miss)
                i = miss.end
        return misses
