"""Database schemas as modules (``kvreuse.modules.schemas``): DDL text, encoding order, catalogs, prompts."""

from __future__ import annotations

import sqlite3

import pytest
from shared_data import dataset

from kvreuse.modules.layout import layout_schema, resolve_prompt
from kvreuse.modules.pml import parse_prompt, parse_schema
from kvreuse.modules.schemas import (
    ForeignKey,
    Table,
    UnknownTable,
    duckdb_schema,
    schema_from_tables,
    spider_schema,
    spider_schemas,
    sqlite_schema,
    text_to_sql_pml,
    text_to_sql_prompt,
)
from kvreuse.modules.trie import ModuleTrie

SPIDER = "spider/tables.json"


def test_spider_tables_render_as_ddl_with_keys():
    farm = spider_schema(dataset(SPIDER), "farm")
    assert farm.table("competition_record").ddl() == (
        "CREATE TABLE competition_record (Competition_ID number, Farm_ID number, Rank number, "
        "PRIMARY KEY (Competition_ID), FOREIGN KEY (Farm_ID) REFERENCES farm(Farm_ID), "
        "FOREIGN KEY (Competition_ID) REFERENCES farm_competition(Competition_ID))\n"
    )


def test_every_spider_table_comes_after_the_tables_it_references():
    schemas = spider_schemas(dataset(SPIDER))
    assert len(schemas) == 166 and sum(len(s.tables) for s in schemas.values()) == 876
    for schema in schemas.values():
        order = {name: i for i, name in enumerate(schema.encoding_order())}
        assert sorted(order) == sorted(t.name for t in schema.tables)
        for table in schema.tables:
            for fk in table.foreign_keys:
                ref = schema.table(fk.table).name
                assert ref == table.name or order[ref] < order[table.name], (schema.name, table.name, ref)
        parse_schema(schema.pml())  # every database is a valid PML schema


def test_a_foreign_key_cycle_is_broken_at_the_first_table_in_catalog_order():
    def t(name, *refs):
        return Table(name, (("id", "int"),), ("id",), tuple(ForeignKey(("id",), r, ("id",)) for r in refs))

    schema = schema_from_tables("loop", [t("c", "a"), t("a", "b"), t("b", "a", "b"), t("d")])
    # c waits for a, a for b, b for a (a cycle; b's self-reference is ignored): nothing is ready but d.
    # Then the cycle is broken at c, first in catalog order; a and b still wait for each other: a is placed.
    assert schema.encoding_order() == ["d", "c", "a", "b"]


def test_an_unknown_table_or_database_is_named_in_the_error():
    farm = spider_schema(dataset(SPIDER), "farm")
    with pytest.raises(UnknownTable, match="database 'farm' has no table 'farms'"):
        text_to_sql_prompt(farm, ["city", "farms"], "How many?")
    with pytest.raises(UnknownTable, match="no database 'farmz'"):
        spider_schema(dataset(SPIDER), "farmz")
    assert farm.table("CITY").name == "city"  # case-insensitive when unambiguous


CATALOG = """
CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE concert (concert_id INTEGER, year INTEGER, PRIMARY KEY (concert_id, year));
CREATE TABLE singer_in_concert (concert_id INTEGER, year INTEGER, singer_id INTEGER,
    FOREIGN KEY (concert_id, year) REFERENCES concert (concert_id, year),
    FOREIGN KEY (singer_id) REFERENCES singer (singer_id));
"""
WANT = (
    "CREATE TABLE singer_in_concert (concert_id INTEGER, year INTEGER, singer_id INTEGER, "
    "FOREIGN KEY (concert_id, year) REFERENCES concert(concert_id, year), "
    "FOREIGN KEY (singer_id) REFERENCES singer(singer_id))\n"
)


def test_sqlite_catalog_gives_columns_and_keys():
    con = sqlite3.connect(":memory:")
    con.executescript(CATALOG)
    schema = sqlite_schema(con, "concerts")
    assert schema.table("concert").primary_key == ("concert_id", "year")
    assert schema.table("singer_in_concert").ddl() == WANT  # foreign keys in declaration order
    assert (
        schema.table("singer").ddl() == "CREATE TABLE singer (singer_id INTEGER, name TEXT, PRIMARY KEY (singer_id))\n"
    )
    assert schema.encoding_order()[-1] == "singer_in_concert"


def test_duckdb_catalog_gives_columns_and_keys():
    import duckdb  # kvreuse[duckdb], which `make test` installs: fails if missing, never skips

    con = duckdb.connect()
    con.execute(CATALOG)
    schema = duckdb_schema(con, "concerts")
    assert schema.table("singer_in_concert").ddl() == WANT
    assert (
        schema.table("singer").ddl() == "CREATE TABLE singer (singer_id INTEGER, name VARCHAR, "
        "PRIMARY KEY (singer_id))\n"
    )
    assert schema.encoding_order() == ["singer", "concert", "singer_in_concert"]


def test_tables_listed_in_any_order_are_found_as_modules_in_the_prompt_tokens(local_tokenizer):
    tok = local_tokenizer
    encode = lambda text: tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    farm = spider_schema(dataset(SPIDER), "farm")
    trie = ModuleTrie((name, encode(ddl)) for name, ddl in farm.modules())
    prompt = encode(text_to_sql_prompt(farm, ["competition_record", "city"], "Which city hosts most?"))
    assert [m.name for m in trie.find(prompt)] == ["competition_record", "city"]


def test_the_pml_request_resolves_to_the_chosen_tables_at_their_schema_positions():
    farm = spider_schema(dataset(SPIDER), "farm")
    chars = lambda text: [ord(c) for c in text]  # noqa: E731
    layout = layout_schema(parse_schema(farm.pml()), chars)
    res = resolve_prompt(parse_prompt(text_to_sql_pml(farm, ["competition_record", "city"], "Which?")), layout, chars)
    assert res.modules == ("competition_record", "city")
    assert res.items[1].start == 0 and res.items[0].start == layout.modules["competition_record"].start > 0
    assert res.items[2].text == "Question: Which?\nSQL:" and res.items[2].start == layout.length
