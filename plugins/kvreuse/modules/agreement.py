"""When a spliced request's output counts as full prefill's: the same tokens, or the same answer as the user reads it.

By default an output agrees with full prefill's only where its tokens are the same (:func:`same_output`). Where a
user reads only part of an output (its first line, the value after ``Answer:``, a JSON field), differences elsewhere
cost nothing, so calibration and the benchmarks can compare outputs after a :class:`Normaliser` the user names: a
short list of steps from a closed set, applied in order to the decoded text of both outputs.

* ``first-line``: the text up to its first line break, leading and trailing whitespace removed;
* ``case``: case folded (``str.casefold``);
* ``whitespace``: every run of whitespace one space, none at either end;
* ``regex:PATTERN``: the first match's first group (the whole match where the pattern has no group), searched with
  Python's ``re``; where nothing matches, the text is left as it is (two outputs without the answer then agree only
  where they are otherwise the same);
* ``json:FIELD``: the field's value (``FIELD`` a key, or dotted keys into nested objects) of the JSON object the
  text holds (from its first ``{`` to its last ``}``), as compact JSON; where the text holds no such object or field,
  the text is left as it is;
* ``sql``: the first SQL statement the text holds (up to ``;``, a code fence, a blank line or the end), everything
  outside quotes lowercased, whitespace runs one space and none next to ``( ) , = < >``: two queries that differ only
  in keyword case, layout or a trailing explanation compare equal, a changed literal or column does not.

Steps are parsed once (:meth:`Normaliser.parse`), bounded and checked there: at most :data:`MAX_STEPS` steps, a
pattern of at most :data:`MAX_PATTERN` characters that compiles, a field of at most :data:`MAX_FIELD_PARTS` keys of
at most :data:`MAX_KEY` characters; anything else raises :class:`~kvreuse.errors.ConfigError` naming the step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvreuse.errors import ConfigError

MAX_STEPS = 8
MAX_PATTERN = 256  # characters of a regex step's pattern
MAX_FIELD_PARTS = 8  # keys of a json step's dotted field
MAX_KEY = 64  # characters of each key
STEPS = ("first-line", "case", "whitespace", "regex:PATTERN", "json:FIELD", "sql")


@dataclass(frozen=True)
class Normaliser:
    """A parsed list of steps (see the module docstring); ``str(normaliser)`` gives them back as typed."""

    steps: tuple[str, ...]
    _apply: tuple[Callable[[str], str], ...]

    @classmethod
    def parse(cls, steps: str | Sequence[str]) -> Normaliser:
        """The normaliser of ``steps``: one step or a list of them, applied in order.

        Raises :class:`ConfigError` naming the first step that is not one of :data:`STEPS` within its bounds.
        """
        given = [steps] if isinstance(steps, str) else list(steps)
        if not given:
            raise ConfigError(f"a normaliser needs at least one step ({', '.join(STEPS)})")
        if len(given) > MAX_STEPS:
            raise ConfigError(f"a normaliser has at most {MAX_STEPS} steps, got {len(given)}")
        return cls(tuple(given), tuple(_step(step) for step in given))

    def __call__(self, text: str) -> str:
        for step in self._apply:
            text = step(text)
        return text

    def __str__(self) -> str:
        return " then ".join(self.steps)


def _step(step: object) -> Callable[[str], str]:
    if not isinstance(step, str):
        raise ConfigError(f"a normaliser step must be a string ({', '.join(STEPS)}), got {type(step).__name__}")
    kind, _, argument = step.partition(":")
    if step == "first-line":
        return _first_line
    if step == "case":
        return str.casefold
    if step == "whitespace":
        return lambda text: " ".join(text.split())
    if step == "sql":
        return sql_statement
    if kind == "regex" and argument:
        return _regex(argument)
    if kind == "json" and argument:
        return _json_field(argument)
    shown = step if len(step) <= 40 else step[:37] + "..."
    raise ConfigError(f"unknown normaliser step {shown!r}; known: {', '.join(STEPS)}")


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def _regex(pattern: str) -> Callable[[str], str]:
    if len(pattern) > MAX_PATTERN:
        raise ConfigError(f"normaliser step regex: the pattern has {len(pattern)} characters, at most {MAX_PATTERN}")
    try:
        compiled = re.compile(pattern)
    except re.error as why:
        raise ConfigError(f"normaliser step regex:{pattern}: not a regular expression ({why})") from None

    def first_match(text: str) -> str:
        found = compiled.search(text)
        if found is None:
            return text
        return found.group(1) if compiled.groups else found.group(0)

    return first_match


def _json_field(field: str) -> Callable[[str], str]:
    keys = field.split(".")
    if len(keys) > MAX_FIELD_PARTS or not all(0 < len(key) <= MAX_KEY for key in keys):
        raise ConfigError(
            f"normaliser step json:{field[:40]}: a field is 1 to {MAX_FIELD_PARTS} keys of 1 to {MAX_KEY} "
            "characters, joined by dots"
        )

    def value(text: str) -> str:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end < start:
            return text
        try:
            found = json.loads(text[start : end + 1])
        except ValueError:
            return text
        for key in keys:
            if not isinstance(found, dict) or key not in found:
                return text
            found = found[key]
        return json.dumps(found, separators=(",", ":"), sort_keys=True)

    return value


_SQL_PIECE = re.compile(
    r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|\s+|[^\s'\"]"
)  # a quoted literal, a space run, a character


def sql_statement(text: str) -> str:
    """The ``sql`` step: the text's first statement with keyword case and layout taken out, quoted literals kept.
    ``"SELECT Name ,  COUNT(*)\\nFROM t;"`` and ``"select name, count(*) from t"`` compare equal."""
    for end in (";", "```", "\n\n"):
        text = text.split(end, 1)[0]
    pieces = []
    for piece in _SQL_PIECE.findall(text.strip()):
        if piece.isspace():
            pieces.append(" ")
        elif piece[0] in "'\"":
            pieces.append(piece)
        else:
            pieces.append(piece.lower())
    return re.sub(r" ?([(),=<>]) ?", r"\1", "".join(pieces)).strip()


def same_output(
    reference: Sequence[int],
    output: Sequence[int],
    normaliser: Callable[[str], str] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> bool:
    """Whether ``output`` agrees with the ``reference`` output (token ids): the same tokens without a normaliser,
    else the same text after it (a :class:`Normaliser`, or any function of the text; ``decode`` turns token ids
    into text)."""
    if normaliser is None:
        return list(reference) == list(output)
    if decode is None:
        raise ValueError("comparing outputs after a normaliser needs a decode function")
    return normaliser(decode(reference)) == normaliser(decode(output))
