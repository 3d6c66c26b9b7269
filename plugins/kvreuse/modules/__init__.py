"""Position-independent module cache (engine-free core): prompt modules encoded once and spliced at any position.

``pml`` parses Prompt Markup Language schemas and prompts, ``layout`` gives each module its token span and
start position and resolves a prompt into the modules it uses and its free text, ``schemas`` turns database
schemas (Spider, SQLite, DuckDB) into table modules and Text-to-SQL prompts, and ``trie`` finds registered modules
inside a plain prompt's tokens. Keys are moved between positions by ``kvreuse.kernels.rerotate``.
"""

from kvreuse.errors import ModuleRegistrationError, PMLError, UnknownTable
from kvreuse.modules.layout import (
    FreeText,
    ModuleSpan,
    Resolution,
    SchemaLayout,
    Segment,
    UsedModule,
    layout_schema,
    resolve_prompt,
)
from kvreuse.modules.pml import parse, parse_prompt, parse_schema, render
from kvreuse.modules.schemas import (
    DatabaseSchema,
    ForeignKey,
    Table,
    duckdb_schema,
    spider_schema,
    spider_schemas,
    sqlite_schema,
    text_to_sql_pml,
    text_to_sql_prompt,
)
from kvreuse.modules.trie import ModuleMatch, ModuleTrie, module_text

__all__ = [
    "DatabaseSchema",
    "ForeignKey",
    "FreeText",
    "ModuleMatch",
    "ModuleRegistrationError",
    "ModuleSpan",
    "ModuleTrie",
    "PMLError",
    "Resolution",
    "SchemaLayout",
    "Segment",
    "Table",
    "UnknownTable",
    "UsedModule",
    "duckdb_schema",
    "layout_schema",
    "module_text",
    "parse",
    "parse_prompt",
    "parse_schema",
    "render",
    "resolve_prompt",
    "spider_schema",
    "spider_schemas",
    "sqlite_schema",
    "text_to_sql_pml",
    "text_to_sql_prompt",
]
