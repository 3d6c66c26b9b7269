"""Putting modules into a vLLM engine that runs the ``KVReuseModuleCache`` connector, and prompts that use them.

A module enters the cache through an *encode request* (see ``kvreuse.vllm.modules.connector``): a one-token generation
whose ``kv_transfer_params`` name the module. :func:`encode_modules` sends them for plain texts or token ids,
:func:`encode_database` for the tables of a database (each table after the tables it references, so its KV attends
to them, as in TableCache), :func:`encode_schema` for every cached run of a PML schema. Afterwards any prompt that
contains a module's tokens is served from the cache; :func:`pml_prompt` turns a PML prompt into such token ids.
Over HTTP, send the same ``kv_transfer_params`` (:func:`encode_params`) with a completion request whose prompt is
the module's token ids.

Plain text must keep a module's tokens the same alone and inside prompts: :func:`module_token_ids` applies the
boundary rules of ``kvreuse.modules.trie`` (text stripped, one trailing newline, no special tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.modules.layout import SchemaLayout, layout_schema, resolve_prompt
from kvreuse.modules.linear import prompt_token_ids, schema_runs
from kvreuse.modules.pml import parse_prompt, parse_schema
from kvreuse.modules.schemas import DatabaseSchema
from kvreuse.modules.trie import module_text
from kvreuse.vllm.modules.common import encode_params

SPECIAL_PREFIX = "<special-prefix>"


def special_prefix(tokenizer: Any) -> list[int]:
    """The token ids the tokenizer adds before every text (e.g. ``[BOS]``; empty for most chat-less tokenizers)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    return list(full[: len(full) - len(plain)]) if full[len(full) - len(plain) :] == plain else []


def module_token_ids(tokenizer: Any, text: str) -> list[int]:
    """A module's token ids: ``module_text(text)`` without special tokens."""
    return list(tokenizer.encode(module_text(text), add_special_tokens=False))


def encode_modules(
    llm: Any, modules: Mapping[str, str | Sequence[int]], contexts: Mapping[str, Sequence[int]] | None = None
) -> dict[str, list[int]]:
    """Encode each module (text, or token ids taken as they are) after its context's token ids (default none).

    Returns the module token ids by name; prompts must contain exactly these ids for the module to be found.
    Encode requests bypass vLLM's prefix cache, so each module is computed from its own tokens.

    The tokens a tokenizer puts before every prompt (a BOS token) are encoded as a module of their own,
    :data:`SPECIAL_PREFIX`: loads start where vLLM's prefix hit ends, at 0 for a new prompt, and would otherwise
    stop at that first token.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = llm.get_tokenizer()
    contexts = contexts or {}
    ids = {
        name: list(value) if not isinstance(value, str) else module_token_ids(tokenizer, value)
        for name, value in modules.items()
    }
    prefix = special_prefix(tokenizer)
    prompts: list[TokensPrompt] = []
    params: list[SamplingParams] = []
    for name, module_ids in ({SPECIAL_PREFIX: prefix, **ids} if prefix else ids).items():
        context = list(contexts.get(name, ()))
        prompts.append(TokensPrompt(prompt_token_ids=context + module_ids))
        params.append(
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                skip_reading_prefix_cache=True,
                extra_args={"kv_transfer_params": encode_params(name, len(context))},
            )
        )
    if prompts:
        llm.generate(prompts, params, use_tqdm=False)
    return ids


def encode_database(llm: Any, schema: DatabaseSchema) -> dict[str, list[int]]:
    """Encode one module per table; a table's context is the DDL of the tables it references.

    Returns the table modules' token ids by table name.
    """
    tokenizer = llm.get_tokenizer()
    texts = dict(schema.modules())
    ids = {name: module_token_ids(tokenizer, text) for name, text in texts.items()}
    contexts = {table.name: [t for name in schema.references(table) for t in ids[name]] for table in schema.tables}
    return encode_modules(llm, ids, contexts)


def schema_layout(llm: Any, schema_pml: str) -> SchemaLayout:
    """Parse and lay out a PML schema with the engine's tokenizer (each text run tokenized alone)."""
    tokenizer = llm.get_tokenizer()
    return layout_schema(parse_schema(schema_pml), lambda text: tokenizer.encode(text, add_special_tokens=False))


def encode_schema(llm: Any, schema_pml: str) -> SchemaLayout:
    """Encode every cached run of a PML schema (``kvreuse.modules.linear.schema_runs``); its layout, for prompts."""
    layout = schema_layout(llm, schema_pml)
    encode_modules(llm, schema_runs(layout))
    return layout


def pml_prompt(llm: Any, prompt_pml: str, layout: SchemaLayout) -> list[int]:
    """Token ids of a PML prompt against an encoded schema; :class:`PMLError` names what is wrong and where."""
    tokenizer = llm.get_tokenizer()
    resolution = resolve_prompt(
        parse_prompt(prompt_pml), layout, lambda text: tokenizer.encode(text, add_special_tokens=False)
    )
    return prompt_token_ids(resolution, layout)
