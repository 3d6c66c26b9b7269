"""Putting modules into a vLLM engine that runs the ``KVReuseModuleCache`` connector, and prompts that use them.

A module enters the cache through an *encode request* (see ``kvreuse.vllm.modules.connector``): a one-token generation
whose ``kv_transfer_params`` name the module. :func:`encode_modules` sends them for plain texts or token ids,
:func:`encode_database` for the tables of a database (each table after the tables it references, so its KV attends
to them, as in TableCache), :func:`encode_schema` for every cached run of a PML schema. Afterwards any prompt that
contains a module's tokens is served from the cache; :func:`pml_prompt` turns a PML prompt into such token ids.
Over HTTP, send the same ``kv_transfer_params`` (:func:`encode_params`) with a completion request whose prompt is
the module's token ids, and the module-write key (``kvreuse.vllm.modules.guard``).

These helpers run in the engine's own process tree, so they are the operator's: they sign each write with the
process tree's local secret (``kvreuse.modules.writes.local_write_proof``), which the engine accepts as it accepts
the HTTP guard's proofs. Their modules are global (every request sees them).

Plain text must keep a module's tokens the same alone and inside prompts: :func:`module_token_ids` applies the
boundary rules of ``kvreuse.modules.trie`` (text stripped, one trailing newline, no special tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.modules.layout import SchemaLayout, layout_schema, resolve_prompt
from kvreuse.modules.linear import prompt_token_ids, schema_runs
from kvreuse.modules.namespace import GLOBAL
from kvreuse.modules.pml import parse_prompt, parse_schema
from kvreuse.modules.schemas import DatabaseSchema
from kvreuse.modules.trie import module_text
from kvreuse.modules.writes import WRITE_PROOF, WriteClaim, content_digest, local_write_proof
from kvreuse.vllm.modules.common import encode_params

SPECIAL_PREFIX = "_special-prefix"  # a valid module name (check_module_name) no schema run can take


def special_prefix(tokenizer: Any) -> list[int]:
    """The token ids the tokenizer adds before every text (e.g. ``[BOS]``; empty for most chat-less tokenizers)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a")
    return list(full[: len(full) - len(plain)]) if full[len(full) - len(plain) :] == plain else []


def module_token_ids(tokenizer: Any, text: str) -> list[int]:
    """A module's token ids: ``module_text(text)`` without special tokens."""
    return list(tokenizer.encode(module_text(text), add_special_tokens=False))


def signed_encode_params(
    name: str, prompt_token_ids: Sequence[int], context_tokens: int = 0, *, replace: bool = False, probe: bool = False
) -> dict[str, Any]:
    """:func:`encode_params` of a global module with this process tree's write proof (offline writes only), for
    the request whose prompt is ``prompt_token_ids`` (the context's tokens, then the module's)."""
    params = encode_params(name, context_tokens, replace=replace, probe=probe)
    claim = WriteClaim(name, int(context_tokens), GLOBAL, replace, probe, content_digest(prompt_token_ids))
    params[WRITE_PROOF] = local_write_proof(claim)
    return params


def encode_modules(
    llm: Any,
    modules: Mapping[str, str | Sequence[int]],
    contexts: Mapping[str, Sequence[int]] | None = None,
    *,
    replace: bool = False,
    probe: Sequence[int] | None = None,
    lora_request: Any = None,
) -> dict[str, list[int]]:
    """Encode each module (text, or token ids taken as they are) after its context's token ids (default none).

    With ``lora_request`` (vLLM's ``LoRARequest``) the modules are computed with that adapter, and only requests
    that run with the same adapter (its name and path) splice them; the base model's encodings of the same names
    stay for requests without one (a name holds one encoding per adapter and context,
    ``kvreuse.modules.encodings``). The same modules after other contexts are kept as other encodings too: a
    request takes the one whose context is its own prompt's (exact), else fits it best.

    With ``probe`` (token ids, e.g. the chat header every prompt starts with), each module is then computed once
    more after ``probe`` and its context, and its tokens are ranked by how far their KV moved
    (``kvreuse.modules.blend``): a splice recomputes the top ``modules.recompute_share`` of them (CacheBlend's
    choice, made here instead of per request). The probe's KV is not stored.

    A name already stored with other content (other tokens or context) is refused (the engine logs
    ``ModuleConflict``) unless ``replace``: then the new entry takes the name, and no block of vLLM's prefix cache
    computed from the old entry can match a prompt again.

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
                extra_args={
                    "kv_transfer_params": signed_encode_params(
                        name, prompts[-1]["prompt_token_ids"], len(context), replace=replace
                    )
                },
            )
        )
    if prompts:
        llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    if probe is not None:  # after the modules are stored: each probe ranks a stored entry
        probes = [TokensPrompt(prompt_token_ids=list(probe) + list(contexts.get(n, ())) + i) for n, i in ids.items()]
        probe_params = [
            SamplingParams(
                max_tokens=1,
                temperature=0.0,
                skip_reading_prefix_cache=True,
                extra_args={
                    "kv_transfer_params": signed_encode_params(
                        name, prompt["prompt_token_ids"], len(probe) + len(contexts.get(name, ())), probe=True
                    )
                },
            )
            for name, prompt in zip(ids, probes)
        ]
        if probes:
            llm.generate(probes, probe_params, use_tqdm=False, lora_request=lora_request)
    return ids


def encode_database(llm: Any, schema: DatabaseSchema, *, lora_request: Any = None) -> dict[str, list[int]]:
    """Encode one module per table; a table's context is the DDL of the tables it references (with
    ``lora_request``: computed with that adapter, as :func:`encode_modules`).

    Each module is stored as ``DATABASE.TABLE``: databases often share table names (``Customers``), and a name
    is stored once per namespace, so bare table names would refuse the second database's tables.
    Returns the table modules' token ids by table name.
    """
    tokenizer = llm.get_tokenizer()
    texts = dict(schema.modules())
    ids = {name: module_token_ids(tokenizer, text) for name, text in texts.items()}
    contexts = {table.name: [t for name in schema.references(table) for t in ids[name]] for table in schema.tables}
    stored = encode_modules(
        llm,
        {f"{schema.name}.{name}": table_ids for name, table_ids in ids.items()},
        {f"{schema.name}.{name}": context for name, context in contexts.items()},
        lora_request=lora_request,
    )
    return {name: stored[f"{schema.name}.{name}"] for name in ids}


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
