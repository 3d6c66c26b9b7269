"""Database schemas as prompt modules, for Text-to-SQL over many schemas.

Each table becomes one module: short DDL-like text,
``CREATE TABLE name (col type, ..., PRIMARY KEY (a, b), FOREIGN KEY (c) REFERENCES t(d))``, one line ending in a
newline (the boundary rule of ``trie.py``, so its tokens are the same alone and inside any prompt). Tables come
from Spider's ``tables.json`` (:func:`spider_schemas`), a SQLite database (:func:`sqlite_schema`) or a DuckDB
catalog (:func:`duckdb_schema`).

Encoding order (:meth:`DatabaseSchema.encoding_order`): every table after the tables it references, so that a
module's cache is computed with the modules it depends on in front of it (Kahn's topological sort; among ready
tables, the catalog's order). A foreign-key cycle is broken deterministically: when no remaining table has all
its references placed, the remaining table that comes first in the catalog's order is placed next, and its
references to tables not yet placed are the edges dropped. Self-references are ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvreuse.errors import UnknownTable
from kvreuse.modules.pml import RESERVED_NAMES, escape


@dataclass(frozen=True)
class ForeignKey:
    columns: tuple[str, ...]
    table: str
    ref_columns: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[tuple[str, str], ...]  # (name, type)
    primary_key: tuple[str, ...] = ()
    foreign_keys: tuple[ForeignKey, ...] = ()

    def ddl(self) -> str:
        """One line of DDL-like text, ending in a newline."""
        parts = [f"{_ident(name)} {kind}".rstrip() for name, kind in self.columns]
        if self.primary_key:
            parts.append(f"PRIMARY KEY ({', '.join(map(_ident, self.primary_key))})")
        for fk in self.foreign_keys:
            parts.append(
                f"FOREIGN KEY ({', '.join(map(_ident, fk.columns))}) REFERENCES "
                f"{_ident(fk.table)}({', '.join(map(_ident, fk.ref_columns))})"
            )
        return f"CREATE TABLE {_ident(self.name)} ({', '.join(parts)})\n"


def _ident(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else '"' + name.replace('"', '""') + '"'


@dataclass(frozen=True)
class DatabaseSchema:
    """The tables of one database, in the catalog's order."""

    name: str
    tables: tuple[Table, ...]

    def table(self, name: str) -> Table:
        """The table called ``name`` (exact, else the only case-insensitive match); :class:`UnknownTable` if none."""
        for table in self.tables:
            if table.name == name:
                return table
        folded = [t for t in self.tables if t.name.lower() == name.lower()]
        if len(folded) == 1:
            return folded[0]
        raise UnknownTable(
            f"database {self.name!r} has no table {name!r} (tables: {', '.join(t.name for t in self.tables)})"
        )

    def references(self, table: Table) -> list[str]:
        """The tables ``table``'s foreign keys reference (resolved as :meth:`table` does), in key order, each once;
        ``table`` itself and tables the schema does not have (dangling keys) are left out."""
        referenced: list[str] = []
        for fk in table.foreign_keys:
            try:
                name = self.table(fk.table).name
            except UnknownTable:
                continue
            if name != table.name and name not in referenced:
                referenced.append(name)
        return referenced

    def encoding_order(self) -> list[str]:
        """Table names, each after the tables it references (see the module docstring for cycles)."""
        by_lower = {t.name.lower(): t.name for t in self.tables}
        refs = {
            t.name: {
                by_lower[fk.table.lower()]
                for fk in t.foreign_keys
                if fk.table.lower() in by_lower and by_lower[fk.table.lower()] != t.name
            }
            for t in self.tables
        }
        placed: list[str] = []
        done: set[str] = set()
        remaining = [t.name for t in self.tables]
        while remaining:
            ready = next((name for name in remaining if refs[name] <= done), remaining[0])  # else: break a cycle
            remaining.remove(ready)
            placed.append(ready)
            done.add(ready)
        return placed

    def modules(self) -> list[tuple[str, str]]:
        """``(table name, DDL text)`` per table in encoding order: the modules to cache."""
        return [(name, self.table(name).ddl()) for name in self.encoding_order()]

    def pml(self) -> str:
        """A PML schema with one module per table, in encoding order; each module is named after its table."""
        body = "".join(
            f'<module name="{escape(_module_name(n), True)}">{escape(ddl)}</module>' for n, ddl in self.modules()
        )
        return f'<schema name="{escape(self.name, True)}">{body}</schema>'


def _module_name(table: str) -> str:
    """A PML tag name for a table: other characters than letters, digits, ``_ . : -`` become ``_``, a leading
    digit gets a ``_`` before it, and a PML tag name (``user``, ``module``, ...) gets ``_table`` after it."""
    name = re.sub(r"[^A-Za-z0-9_.:-]", "_", table)
    name = name if re.match(r"[A-Za-z_]", name) else "_" + name
    return name + "_table" if name in RESERVED_NAMES else name


def text_to_sql_prompt(schema: DatabaseSchema, tables: Sequence[str], question: str) -> str:
    """A plain Text-to-SQL prompt: the chosen tables' DDL in the order given, then the question.

    Each DDL line is exactly the module's text, so :class:`kvreuse.modules.trie.ModuleTrie` finds the tables in
    the prompt's tokens. An unknown table raises :class:`UnknownTable` naming it and the database.
    """
    ddl = "".join(schema.table(name).ddl() for name in tables)
    return f"Database {schema.name}:\n{ddl}Question: {question.strip()}\nSQL:"


def text_to_sql_pml(schema: DatabaseSchema, tables: Sequence[str], question: str) -> str:
    """The same request as a PML prompt against :meth:`DatabaseSchema.pml`."""
    imports = "".join(f"<{_module_name(schema.table(name).name)}/>" for name in tables)
    return f'<prompt schema="{escape(schema.name, True)}">{imports}Question: {escape(question.strip())}\nSQL:</prompt>'


# ----------------------------------------------------------------------------------------------------------------
# Catalogs


def spider_schemas(path: str | Path) -> dict[str, DatabaseSchema]:
    """Every database of a Spider ``tables.json`` by ``db_id`` (original table and column names)."""
    out = {}
    for db in json.loads(Path(path).read_text(encoding="utf-8")):
        names = db["table_names_original"]
        cols = db["column_names_original"]
        types = db["column_types"]
        columns: list[list[tuple[str, str]]] = [[] for _ in names]
        for (table, col), kind in zip(cols, types):
            if table >= 0:
                columns[table].append((col, kind))
        pk: list[list[str]] = [[] for _ in names]
        for entry in db["primary_keys"]:
            for index in entry if isinstance(entry, list) else [entry]:
                pk[cols[index][0]].append(cols[index][1])
        fks: list[list[ForeignKey]] = [[] for _ in names]
        for src, dst in db["foreign_keys"]:
            fks[cols[src][0]].append(ForeignKey((cols[src][1],), names[cols[dst][0]], (cols[dst][1],)))
        out[db["db_id"]] = DatabaseSchema(
            db["db_id"],
            tuple(Table(name, tuple(columns[i]), tuple(pk[i]), tuple(fks[i])) for i, name in enumerate(names)),
        )
    return out


def spider_schema(path: str | Path, db_id: str) -> DatabaseSchema:
    """One database of a Spider ``tables.json``; :class:`UnknownTable` if ``db_id`` is not there."""
    schemas = spider_schemas(path)
    if db_id not in schemas:
        raise UnknownTable(f"no database {db_id!r} in {path}")
    return schemas[db_id]


def sqlite_schema(connection, name: str = "main") -> DatabaseSchema:
    """Tables of a SQLite database (a ``sqlite3`` connection): columns, declared types, primary and foreign keys."""
    rows = connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
    ).fetchall()
    tables = []
    for (table,) in rows:
        info = connection.execute(f"PRAGMA table_info({_ident(table)})").fetchall()  # cid, name, type, ., ., pk
        pk = tuple(col for _, col, _, _, _, order in sorted(info, key=lambda r: r[5]) if order)
        groups: dict[int, list] = {}
        for fk in connection.execute(f"PRAGMA foreign_key_list({_ident(table)})").fetchall():
            groups.setdefault(fk[0], []).append(fk)  # id, seq, table, from, to, ...
        fks = tuple(
            ForeignKey(tuple(r[3] for r in g), g[0][2], tuple(r[4] or "" for r in g))
            for _, g in sorted(groups.items(), reverse=True)
        )  # SQLite numbers them from the last declared
        tables.append(Table(table, tuple((col, kind) for _, col, kind, _, _, _ in info), pk, fks))
    return DatabaseSchema(name, tuple(tables))


def duckdb_schema(connection, name: str | None = None, schema: str = "main") -> DatabaseSchema:
    """Tables of one DuckDB schema (``duckdb_columns()``, ``duckdb_constraints()``)."""
    tables = [
        t
        for (t,) in connection.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = ? AND NOT internal ORDER BY table_oid", [schema]
        ).fetchall()
    ]
    columns: dict[str, list[tuple[str, str]]] = {t: [] for t in tables}
    for table, col, kind in connection.execute(
        "SELECT table_name, column_name, data_type FROM duckdb_columns() WHERE schema_name = ? AND NOT internal "
        "ORDER BY table_oid, column_index",
        [schema],
    ).fetchall():
        if table in columns:
            columns[table].append((col, kind))
    pks: dict[str, tuple[str, ...]] = {}
    fks: dict[str, list[ForeignKey]] = {t: [] for t in tables}
    for table, kind, cols, ref_table, ref_cols in connection.execute(
        "SELECT table_name, constraint_type, constraint_column_names, referenced_table, referenced_column_names "
        "FROM duckdb_constraints() WHERE schema_name = ? AND constraint_type IN ('PRIMARY KEY', 'FOREIGN KEY') "
        "ORDER BY table_oid, constraint_index",
        [schema],
    ).fetchall():
        if kind == "PRIMARY KEY":
            pks[table] = tuple(cols)
        elif table in fks:
            fks[table].append(ForeignKey(tuple(cols), ref_table, tuple(ref_cols)))
    return DatabaseSchema(
        name or schema, tuple(Table(t, tuple(columns[t]), pks.get(t, ()), tuple(fks[t])) for t in tables)
    )


def schema_from_tables(name: str, tables: Iterable[Table] | Mapping[str, Table]) -> DatabaseSchema:
    """A schema built by hand (tests, catalogs kvreuse does not read)."""
    return DatabaseSchema(name, tuple(tables.values() if isinstance(tables, Mapping) else tables))
