"""A multi-document QA set for measuring answers over spliced modules: deterministic, made up, no network.

Each case is a chat prompt: a short shared header (system turn, then the user turn's opening), several modules
(documents), then a question about one field of one module and the assistant turn's opening: extraction of one
field value from one document among several. Modules of the asked kind besides the answer's (``same_kind`` of
them) hold the same fields with other values, so an answer is right only if the model read the right module; the
others are of other kinds, as in a retrieval-augmented prompt.

Three kinds of module, each stating its facts next to the entity's name (a 135M model copies a value it finds
next to the name; it does not look a column up in a Markdown table, nor a key under a section heading: 0 of 36
and 1 of 10 right in trials; with every module of the asked kind, full prefill answered 14 of 30):

* ``profile``: prose about a made-up person (town, job, pet, access code, favourite colour, birth year) among
  filler sentences;
* ``table``: one row of a wide products table, verbalised one column per line ("The price in euros of Gairdil Vorn
  is 73."): maker, price, stock, warehouse and item code, among other columns;
* ``config``: a server's section of an inventory, the way a PML schema holds one module per server, one setting
  per line: owner, region, port, backup window, rack, among other settings.

Modules come from a pool per kind and recur across cases, as they would in a module cache. A case draws its
modules and their order at random; no other module holds the asked value.

Values are short and distinctive (made-up words, codes like ``KX-4172``), so a right answer cannot be guessed.
The question ends with the opening of the answer ("The access code of Zorvik Tallen is"): the model's job is to
find the value and copy it.

The schema workload (``SCHEMA_SETS``, :func:`make_schema_cases`, at the end of this file) is the other kind of
case: Spider database schemas, one module per table, and a question asking for a SQL query; it has no answers, and
a splice is compared with full prefill on the normalised SQL (:func:`normalise_sql`).

Answers are checked on the output's first line (:func:`is_correct`): the gold value, normalised (lowercase,
letters and digits only), must occur in it and no other module's value of the same field may occur before it.

Token ids: a case is built from the header's, each module's and the question's token ids, concatenated, and
module texts follow ``kvreuse.modules.trie.module_text`` (no surrounding whitespace, one trailing newline), so
the ids of a module are the same alone and inside the prompt and kvreuse's token trie finds every module.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Tokenize = Callable[[str], list[int]]

HEADER = (
    "<|im_start|>system\nYou answer questions about the documents the user gives. Answer with the value only."
    "<|im_end|>\n<|im_start|>user\n"
)
KINDS = ("profile", "table", "config")

_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "r", "s", "t", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ei", "ou")
_CODAS = ("", "", "l", "n", "r", "s", "th", "v", "x", "nd", "rk")
_COLORS = (
    "teal", "amber", "crimson", "olive", "violet", "saffron", "indigo", "coral", "maroon", "turquoise",
    "lavender", "ochre", "scarlet", "beige", "magenta", "emerald", "charcoal", "ivory", "cobalt", "mustard",
)  # fmt: skip
_JOBS = (
    "glassblower", "beekeeper", "cartographer", "locksmith", "tailor", "surveyor", "potter", "ferryman",
    "bookbinder", "clockmaker", "falconer", "chandler", "cooper", "stonemason", "weaver", "brewer",
)  # fmt: skip
_PETS = ("ferret", "parrot", "tortoise", "rabbit", "goat", "hedgehog", "lizard", "canary", "pony", "cat")
_FILLER = (
    "{n} likes to walk along the river in the early morning.",
    "{n} reads old history books in the evening.",
    "Friends describe {n} as patient and quiet.",
    "{n} often visits the market on the first day of the month.",
    "In the summer {n} travels to the coast for a week.",
    "{n} keeps a small garden with herbs and tomatoes.",
    "{n} learned to swim as a child and still swims every week.",
    "Neighbours say that {n} is always on time.",
    "{n} has two older brothers and one younger sister.",
    "{n} prefers tea to coffee and rarely eats meat.",
    "Every winter {n} repairs the roof of the old shed.",
    "{n} once won a local chess tournament.",
    "{n} collects postcards from faraway towns.",
    "On rainy days {n} writes long letters to old friends.",
    "{n} plays the violin, though not very well.",
    "{n} sleeps with the window open, even in winter.",
)


@dataclass(frozen=True)
class Module:
    """One document: its text (``module_text`` form) and its field values (what questions ask for)."""

    name: str
    text: str
    fields: dict[str, str]


@dataclass(frozen=True)
class Case:
    """A prompt: ``HEADER``, ``modules`` in order, then ``question``; ``answer`` is ``modules[target]``'s
    ``field``. ``distractors`` are the other modules' values of that field."""

    key: str
    kind: str
    modules: tuple[Module, ...]
    target: int
    field: str
    question: str
    answer: str
    distractors: tuple[str, ...]


@dataclass(frozen=True)
class TokenizedCase:
    """A case's token ids: ``header + modules[0] + ... + question`` is the prompt. ``contexts[i]``: the token ids
    module ``i`` is encoded after where it has a context of its own (a schema's referenced tables), else none."""

    case: Case | SchemaCase
    header: tuple[int, ...]
    modules: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]
    contexts: tuple[tuple[int, ...], ...] = ()

    @property
    def prompt(self) -> list[int]:
        return [*self.header, *(t for m in self.modules for t in m), *self.question]

    def module_starts(self) -> list[int]:
        """Prompt position of each module's first token."""
        starts, pos = [], len(self.header)
        for ids in self.modules:
            starts.append(pos)
            pos += len(ids)
        return starts


class _Names:
    """Made-up words, never the same twice in one generator."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS) for _ in range(syllables)
            ).capitalize()
            if w not in self.used and 4 <= len(w) <= 10:
                self.used.add(w)
                return w

    def code(self) -> str:
        while True:
            letters = self.rng.choice("BCDFGHJKLMNPQRSTVWXZ") + self.rng.choice("ABCDEFGHKLMNPRSTUVXYZ")
            c = f"{letters}-{self.rng.randint(1000, 9999)}"
            if c not in self.used:
                self.used.add(c)
                return c


def _fill(sentences: list[str], extra: Sequence[str], tokenize: Tokenize, target: int, rng: random.Random) -> str:
    """Append filler sentences (shuffled, without repeats while they last) until the text reaches ``target``
    tokens; the fields stay where they are."""
    pool = list(extra)
    rng.shuffle(pool)
    text = " ".join(sentences)
    while len(tokenize(text + "\n")) < target and pool:
        cut = rng.randint(1, len(sentences))  # filler lands anywhere, not only at the end
        sentences.insert(cut, pool.pop())
        text = " ".join(sentences)
    return text + "\n"


def _profile(names: _Names, rng: random.Random, tokenize: Tokenize, target: int) -> Module:
    """Prose about a person: the asked facts among filler sentences."""
    person = f"{names.word(2)} {names.word(2)}"
    values = {
        "city": names.word(2),
        "job": rng.choice(_JOBS),
        "pet": f"{rng.choice(_PETS)} named {names.word(2)}",
        "code": names.code(),
        "color": rng.choice(_COLORS),
        "year": str(rng.randint(1931, 1999)),
    }
    sentences = [
        f"{person} is a {values['job']} who lives in the town of {values['city']}.",
        f"{person} was born in {values['year']}.",
        f"{person} keeps a {values['pet']}.",
        f"The access code of {person} is {values['code']}.",
        f"The favourite colour of {person} is {values['color']}.",
    ]
    first = person.split()[0]
    filler = [s.format(n=first) for s in _FILLER]
    return Module(person, _fill(sentences, filler, tokenize, target, rng), values)


def _fact(column: str, entity: str, value: str) -> str:
    """``price in euros`` -> ``The price in euros of X is 42.``"""
    return f"The {column} of {entity} is {value}."


_PRODUCT_NOTES = (
    "Customers say it is sturdy and easy to clean.",
    "It is often bought together with spare parts.",
    "The design was changed slightly two years ago.",
    "Most orders are shipped within two days.",
    "Reviews praise the finish but not the manual.",
    "It is popular with small workshops and schools.",
    "Sales rise every spring and fall in the winter.",
    "A cheaper version was sold until last year.",
    "The packaging is made from recycled paper.",
    "Returned items are checked and sold again at a lower price.",
    "Some buyers asked for more colours.",
    "It fits in a standard shelf without tools.",
    "The instructions come in four languages.",
    "Shops in the north order it more often than shops in the south.",
    "It was shown at a trade fair when it was launched.",
    "Repairs are done by the maker's own service team.",
)
_SERVER_NOTES = (
    "Note: it was moved to new hardware last spring.",
    "Note: restarts must be announced one day before.",
    "Note: the team plans to retire it within two years.",
    "Note: logs are kept for ninety days.",
    "Note: access is granted through the usual ticket process.",
    "Note: its load is highest at the end of each month.",
    "Note: a spare disk is kept in the same hall.",
    "Note: updates are installed on the first weekend of the month.",
    "Note: it shares a power circuit with its neighbours.",
    "Note: alerts go to the on-call engineer first.",
    "Note: its configuration is stored in the central repository.",
    "Note: the fans were replaced after an overheating incident.",
    "Note: it handles traffic for several internal tools.",
    "Note: a second network card was added for backups.",
    "Note: the local clock is synchronised every hour.",
    "Note: old snapshots are deleted automatically.",
)


def _facts(
    entity: str,
    facts: dict[str, str],
    extra: dict[str, str],
    notes: Sequence[str],
    tokenize: Tokenize,
    target: int,
    title: str,
    rng: random.Random,
) -> str:
    """A record as one ``The <column> of <entity> is <value>.`` line per column: the asked columns and four
    more, then notes without values (in random places) until the text reaches ``target`` tokens (more columns of
    the same form confuse the model more than they test it)."""
    lines = [_fact(column, entity, value) for column, value in facts.items()]
    lines += [_fact(column, entity, value) for column, value in rng.sample(sorted(extra.items()), 4)]
    rng.shuffle(lines)
    pool = list(notes)
    rng.shuffle(pool)
    while pool and len(tokenize("\n".join([title, *lines]) + "\n")) < target:
        lines.insert(rng.randint(0, len(lines)), pool.pop())
    return "\n".join([title, *lines]) + "\n"


def _table(names: _Names, rng: random.Random, tokenize: Tokenize, target: int) -> Module:
    """One row of a wide products table, verbalised one column per line (a 135M model does not read Markdown
    tables: 0 of 36 lookups right in a trial)."""
    product = f"{names.word(2)} {names.word(1)}"
    values = {
        "maker": f"{names.word(2)} Works",
        "price in euros": str(rng.randint(10, 99)),
        "stock in units": str(rng.randint(100, 999)),
        "warehouse": names.word(2),
        "item code": names.code(),
    }
    extra = {
        "weight": f"{rng.randint(1, 40)} kg",
        "colour": rng.choice(_COLORS),
        "category": rng.choice(("tools", "garden", "kitchen", "toys", "office", "sports", "lighting")),
        "rating": f"{rng.randint(1, 5)} stars",
        "width": f"{rng.randint(5, 120)} cm",
        "height": f"{rng.randint(5, 120)} cm",
        "material": rng.choice(("oak", "steel", "glass", "cotton", "plastic", "brass", "wool")),
        "warranty": f"{rng.randint(1, 5)} years",
        "supplier country": names.word(2),
        "launch year": str(rng.randint(1990, 2024)),
        "packaging": rng.choice(("box", "crate", "bag", "tube", "envelope")),
        "discount": f"{rng.randint(0, 40)} percent",
        "shelf": f"{rng.choice('ABCDEFGH')}{rng.randint(1, 40)}",
        "returns last year": str(rng.randint(0, 90)),
        "buyer": f"{names.word(2)} {names.word(2)}",
        "power": f"{rng.randint(5, 2000)} watts",
    }
    title = f"Products table, row {rng.randint(100, 999)}: {product}."
    return Module(product, _facts(product, values, extra, _PRODUCT_NOTES, tokenize, target, title, rng), values)


def _config(names: _Names, rng: random.Random, tokenize: Tokenize, target: int) -> Module:
    """A server's section of an inventory, the way a PML schema would hold one module per server."""
    server = f"server {names.word(2)} {names.word(1)}"
    values = {
        "owner": f"{names.word(2)} {names.word(2)}",
        "region": names.word(2),
        "port": str(rng.randint(2000, 9999)),
        "backup window": f"{rng.randint(0, 23):02d}:{rng.choice(('00', '15', '30', '45'))}",
        "rack": names.code(),
    }
    extra = {
        "operating system": rng.choice(("debian 12", "alpine 3.19", "ubuntu 22.04", "rocky 9")),
        "status": rng.choice(("active", "standby", "draining")),
        "monitoring level": rng.choice(("basic", "full", "none")),
        "cluster": f"{names.word(2).lower()} pool",
        "contact": f"{names.word(2).lower()}@{names.word(2).lower()}.example",
        "power feed": f"{rng.choice('AB')}{rng.randint(1, 4)}",
        "service": names.word(2).lower(),
        "ticket queue": f"{names.word(1).lower()}-ops",
        "hardware vendor": rng.choice(("Velmora", "Tarnic", "Osbel", "Quenta")),
        "backup target": f"{names.word(2).lower()} vault",
        "environment": rng.choice(("production", "staging", "testing")),
    }
    title = f"Inventory section: {server}."
    return Module(server, _facts(server, values, extra, _SERVER_NOTES, tokenize, target, title, rng), values)


_PROFILE_QUESTIONS = {
    "city": ("In which town does {e} live?", "{e} lives in the town of"),
    "code": ("What is the access code of {e}?", "The access code of {e} is"),
    "color": ("What is the favourite colour of {e}?", "The favourite colour of {e} is"),
    "year": ("In which year was {e} born?", "{e} was born in"),
    "pet": ("Which pet does {e} keep?", "{e} keeps a"),
    "job": ("What does {e} do for a living?", "{e} is a"),
}
_TABLE_QUESTIONS = {
    "maker": ("Who is the maker of {e}?", "The maker of {e} is"),
    "price in euros": ("What is the price of {e} in euros?", "The price in euros of {e} is"),
    "stock in units": ("How many units of {e} are in stock?", "The stock in units of {e} is"),
    "warehouse": ("In which warehouse is {e} kept?", "The warehouse of {e} is"),
    "item code": ("What is the item code of {e}?", "The item code of {e} is"),
}
_CONFIG_QUESTIONS = {
    "owner": ("Who is the owner of {e}?", "The owner of {e} is"),
    "region": ("In which region is {e}?", "The region of {e} is"),
    "port": ("Which port does {e} use?", "The port of {e} is"),
    "backup window": ("When is the backup window of {e}?", "The backup window of {e} is"),
    "rack": ("In which rack is {e}?", "The rack of {e} is"),
}


def question_text(question: str, opening: str) -> str:
    """The prompt's end: the question, the user turn's close and the assistant turn opened by ``opening``."""
    return f"Question: {question}<|im_end|>\n<|im_start|>assistant\n{opening}"


_QUESTIONS = {"profile": _PROFILE_QUESTIONS, "table": _TABLE_QUESTIONS, "config": _CONFIG_QUESTIONS}


def make_pool(
    kind: str, size: int, module_tokens: tuple[int, int], rng: random.Random, tokenize: Tokenize
) -> list[Module]:
    """``size`` modules of ``kind``, each of a length drawn from ``module_tokens``; no two share a name."""
    names = _Names(rng)
    build = {"profile": _profile, "table": _table, "config": _config}.get(kind)
    if build is None:
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    return [build(names, rng, tokenize, rng.randint(*module_tokens)) for _ in range(size)]


def make_case(
    key: str, kind: str, pools: dict[str, Sequence[Module]], num_modules: int, same_kind: int, rng: random.Random
) -> Case:
    """One case: a question about a field of one module of ``kind``, among ``num_modules`` modules in random
    order: ``same_kind`` more of that kind (which never hold the asked value, so only the right module gives the
    answer), the rest of the other kinds."""
    target_module = rng.choice(pools[kind])
    fld = rng.choice(tuple(_QUESTIONS[kind]))
    answer = target_module.fields[fld]
    same = min(same_kind, num_modules - 1)
    alike = rng.sample([m for m in pools[kind] if m is not target_module and m.fields[fld] != answer], same)
    unlike = [m for other in KINDS if other != kind for m in pools[other]]
    others = alike + rng.sample(unlike, num_modules - 1 - same)
    rng.shuffle(others)
    target = rng.randrange(num_modules)
    modules = (*others[:target], target_module, *others[target:])
    question, opening = _QUESTIONS[kind][fld]
    text = question_text(question.format(e=target_module.name), opening.format(e=target_module.name))
    return Case(key, kind, modules, target, fld, text, answer, tuple(m.fields[fld] for m in alike))


@dataclass(frozen=True)
class QASet:
    """A named set of cases: ``num_modules`` modules (drawn per case) of ``module_tokens`` tokens (per module)
    from a pool of ``pool_size`` modules per kind."""

    name: str
    num_cases: int
    num_modules: tuple[int, ...]
    module_tokens: tuple[int, int]
    pool_size: int
    same_kind: int  # modules of the asked kind besides the answer's (the rest are of the other kinds)


QA_SETS = {
    # The study's set: 3-6 modules of 100-200 tokens.
    "mixed": QASet("mixed", 300, (3, 4, 5, 6), (100, 200), 48, 1),
    # The TTFT size: 8 modules of about 256 tokens.
    "long": QASet("long", 96, (8,), (240, 256), 32, 2),
    # Issue 27's curves: 1, 2, 4 and 8 documents of 100-140 tokens (the issue's held-out set had four of ~115).
    **{f"docs-{n}": QASet(f"docs-{n}", 60, (n,), (100, 140), 32, 1) for n in (1, 2, 4, 8)},
}


def make_cases(qa_set: QASet, tokenize: Tokenize, seed: int = 0) -> list[Case]:
    """The set's cases, the same for the same seed and tokenizer; kinds rotate. Modules recur across cases (as
    they would in a module cache), so each is encoded once."""
    rng = random.Random(f"{qa_set.name}-{seed}")
    pools = {kind: make_pool(kind, qa_set.pool_size, qa_set.module_tokens, rng, tokenize) for kind in KINDS}
    return [
        make_case(f"{qa_set.name}-{i}", kind, pools, rng.choice(qa_set.num_modules), qa_set.same_kind, rng)
        for i, kind in ((i, KINDS[i % len(KINDS)]) for i in range(qa_set.num_cases))
    ]


def tokenize_case(case: Case, tokenize: Tokenize) -> TokenizedCase:
    """Token ids of the case's parts, each tokenized alone (module ids are the same inside the prompt)."""
    return TokenizedCase(
        case,
        tuple(tokenize(HEADER)),
        tuple(tuple(tokenize(m.text)) for m in case.modules),
        tuple(tokenize(case.question)),
    )


def normalise(text: str) -> str:
    """Lowercase letters and digits only: ``"KX-4172."`` and ``"kx 4172"`` compare equal."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def is_correct(output: str, case: Case) -> bool:
    """The gold value occurs in the output's first line, and no other module's value of the field before it."""
    line = normalise(output.strip().split("\n")[0])
    gold = normalise(case.answer)
    at = line.find(gold)
    if at < 0:
        return False
    return not any((d := normalise(x)) and d != gold and 0 <= line.find(d) < at for x in case.distractors)


# ----------------------------------------------------------------------------------------------------------------
# The schema workload: database schemas as modules (TableCache's case), questions asking for a SQL query.
#
# Each case is a chat prompt: a header (system turn, the user turn's opening), the DDL of several tables of one
# Spider database (``kvreuse.modules.schemas``: one ``CREATE TABLE`` line per table, a module each), in foreign-key
# order (every table after the tables of the prompt it references, as TableCache encodes them), then a question over
# those tables' own columns and the assistant turn opened with ``SELECT``. There are no gold queries: what is
# measured is whether a splice gives full prefill's query, compared on the normalised SQL (:func:`normalise_sql`).
# A case's tables are connected by their foreign keys where the database allows (a table, then tables that reference
# or are referenced by the ones chosen, at random), so most questions can ask for a join. Databases rotate over the
# cases, so each table recurs across cases as a module would in a cache.

SCHEMA_HEADER = (
    "<|im_start|>system\nYou write SQLite queries. The user gives the tables of a database and a question; answer "
    "with one SQL query only.<|im_end|>\n<|im_start|>user\n"
)
SQL_OPENING = "SELECT"


@dataclass(frozen=True)
class SchemaCase:
    """A prompt: ``SCHEMA_HEADER``, the DDL of ``tables`` (of database ``database``) in order, then ``question``.
    ``references[i]``: the tables of the database that ``tables[i]`` references (in key order), whose DDL a TableCache
    encoding puts before it; ``template``: the kind of question."""

    key: str
    database: str
    tables: tuple[str, ...]
    modules: tuple[str, ...]  # each table's DDL (a module's text)
    references: tuple[tuple[str, ...], ...]
    reference_texts: tuple[tuple[str, ...], ...]  # the referenced tables' DDL
    question: str
    template: str


@dataclass(frozen=True)
class SchemaSet:
    """A named set of ``num_cases`` schema cases of ``num_tables`` tables each; outputs of up to ``max_tokens``."""

    name: str
    num_cases: int
    num_tables: int
    max_tokens: int = 32
    databases: int = 20  # the cases take turns over this many databases, so each table recurs


SCHEMA_SETS = {f"schema-{n}": SchemaSet(f"schema-{n}", 60, n) for n in (2, 4, 8)}


def _columns(table, kinds: tuple[str, ...] = ()) -> list[str]:
    """``table``'s column names (of the Spider types ``kinds``, all without), key columns last."""
    keys = set(table.primary_key) | {c for fk in table.foreign_keys for c in fk.columns}
    cols = [name for name, kind in table.columns if not kinds or kind in kinds]
    return [c for c in cols if c not in keys] + [c for c in cols if c in keys]


def _question(schema, tables: Sequence[str], rng: random.Random) -> tuple[str, str]:
    """A question over ``tables`` of ``schema`` and its template's name: a join along a foreign key between two of
    the tables where they have one (two of three cases), else one of five single-table kinds."""
    chosen = [schema.table(name) for name in tables]
    links = [
        (t, fk, schema.table(fk.table))
        for t in chosen
        for fk in t.foreign_keys
        if fk.table.lower() in {n.lower() for n in tables} and schema.table(fk.table).name != t.name
    ]
    if links and rng.random() < 2 / 3:
        table, fk, ref = rng.choice(links)
        own, theirs = rng.choice(_columns(table)), rng.choice(_columns(ref))
        if rng.random() < 0.5:
            return (
                f"For each row of {table.name}, give its {own} and the {theirs} of the {ref.name} row it refers to.",
                "join",
            )
        return f"How many rows of {table.name} refer to each {ref.name}? Give the {theirs} and the count.", "join-count"
    table = rng.choice(chosen)
    numbers, words = _columns(table, ("number",)), _columns(table, ("text",))
    anything = _columns(table)
    kinds = ["count", "list"] + (["filter", "aggregate", "top"] if numbers else []) + (["group"] if words else [])
    kind = rng.choice(kinds)
    if kind == "count":
        return f"How many rows does the table {table.name} have?", kind
    if kind == "list":
        a, b = rng.sample(anything, 2) if len(anything) > 1 else (anything[0], anything[0])
        return f"List the {a} and the {b} of every row of {table.name}.", kind
    if kind == "group":
        return f"For each {rng.choice(words)} in {table.name}, how many rows are there?", kind
    number = rng.choice(numbers)
    if kind == "filter":
        shown = rng.choice([c for c in anything if c != number] or [number])
        return f"Which rows of {table.name} have a {number} above {rng.randint(2, 90)}? Give their {shown}.", kind
    if kind == "aggregate":
        how = rng.choice(("average", "largest", "smallest", "total"))
        return f"What is the {how} {number} over all rows of {table.name}?", kind
    shown = rng.choice([c for c in anything if c != number] or [number])
    return f"Which {shown} of {table.name} has the highest {number}?", kind


def _connected_tables(schema, n: int, rng: random.Random) -> list[str]:
    """``n`` tables of ``schema``, grown from a random one along foreign keys (either way), then any others."""
    neighbours: dict[str, set[str]] = {t.name: set() for t in schema.tables}
    for table in schema.tables:
        for ref in schema.references(table):
            neighbours[table.name].add(ref)
            neighbours[ref].add(table.name)
    chosen = [rng.choice(sorted(neighbours))]
    while len(chosen) < n:
        frontier = sorted({m for t in chosen for m in neighbours[t]} - set(chosen))
        rest = sorted(set(neighbours) - set(chosen))
        chosen.append(rng.choice(frontier or rest))
    return chosen


def make_schema_cases(schema_set: SchemaSet, schemas: dict, seed: int = 0) -> list[SchemaCase]:
    """The set's cases over ``databases`` of the databases of ``schemas`` (``kvreuse.modules.schemas.spider_schemas``)
    with at least ``num_tables`` tables, drawn at random, taken in turn; the same for the same seed."""
    rng = random.Random(f"{schema_set.name}-{seed}")
    databases = [name for name in sorted(schemas) if len(schemas[name].tables) >= schema_set.num_tables]
    rng.shuffle(databases)
    databases = databases[: schema_set.databases]
    cases = []
    for i in range(schema_set.num_cases):
        schema = schemas[databases[i % len(databases)]]
        picked = set(_connected_tables(schema, schema_set.num_tables, rng))
        tables = tuple(name for name in schema.encoding_order() if name in picked)
        question, template = _question(schema, tables, rng)
        references = tuple(tuple(schema.references(schema.table(name))) for name in tables)
        cases.append(
            SchemaCase(
                f"{schema_set.name}-{i}",
                schema.name,
                tables,
                tuple(schema.table(name).ddl() for name in tables),
                references,
                tuple(tuple(schema.table(r).ddl() for r in refs) for refs in references),
                question,
                template,
            )
        )
    return cases


def schema_question_text(question: str) -> str:
    """The prompt's end: the question, the user turn's close and the assistant turn opened with ``SELECT``."""
    return f"Question: {question}<|im_end|>\n<|im_start|>assistant\n{SQL_OPENING}"


def tokenize_schema_case(case: SchemaCase, tokenize: Tokenize) -> TokenizedCase:
    """Token ids of the case's parts, each tokenized alone (a table's ids are the same inside the prompt), with each
    table's TableCache context: its referenced tables' ids, in key order."""
    return TokenizedCase(
        case,
        tuple(tokenize(SCHEMA_HEADER)),
        tuple(tuple(tokenize(text)) for text in case.modules),
        tuple(tokenize(schema_question_text(case.question))),
        tuple(tuple(t for text in texts for t in tokenize(text)) for texts in case.reference_texts),
    )


def normalise_sql(output: str) -> str:
    """The query an output gives (after the prompt's ``SELECT``), as two queries are compared: the module cache's
    ``sql`` normaliser step (``kvreuse.modules.agreement.sql_statement``) over the opening and the output."""
    from kvreuse.modules.agreement import sql_statement

    return sql_statement(f"{SQL_OPENING} {output}")
