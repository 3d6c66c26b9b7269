"""No engine-private name outside ``patches/``: everything kvreuse touches of vLLM's and SGLang's internals goes
through ``kvreuse.patches`` (read with ``ast``, nothing run).

Engine-private, operationally:

* in the modules that face an engine (the adapters, and any module importing vLLM, SGLang or ``prometheus_client``):
  any attribute starting with one underscore (``obj._registry``, ``getattr(obj, "_name")``) that kvreuse does not
  define itself, and any such name imported from another package;
* every internal name of the boundary manifests (the symbols the ``@MANIFEST.touches`` decorators of
  ``patches/*.py`` list: ``find_longest_cache_hit``, ``waiting_lora_adapters``, ...), used as an attribute
  (``x.name``, ``getattr(x, "name")``) or imported. A name that kvreuse also defines, or that is also an interface
  name (``block_size``, ``shutdown``), cannot be told apart this way; those are listed in :data:`AMBIGUOUS` and left
  to review.
"""

from __future__ import annotations

import ast

import pytest
from source_tree import Module, modules, runtime_nodes, third_party_imports

MODULES = modules()
PACKAGE = {name: module for name, module in MODULES.items() if not name.startswith("kvreuse.patches")}
BOUNDARY = {name: module for name, module in MODULES.items() if name.startswith("kvreuse.patches.")}
ATTRIBUTE_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}
# The packages whose objects count as engine objects (prometheus_client: vLLM's metrics registry).
ENGINE_PACKAGES = {"vllm", "sglang", "prometheus_client"}


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def defined_names(modules: dict[str, Module]) -> set[str]:
    """Names kvreuse defines that can be reached as attributes: functions, methods and classes, module and class
    variables, and attributes it assigns (``self.x = ...``); not the local variables of functions."""
    names: set[str] = set()
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            for target in _targets(node):
                names.update(part.attr for part in ast.walk(target) if isinstance(part, ast.Attribute))
        scopes = [module.tree, *(n for n in ast.walk(module.tree) if isinstance(n, ast.ClassDef))]
        for scope in scopes:
            for statement in scope.body:
                for target in _targets(statement):
                    names.update(part.id for part in ast.walk(target) if isinstance(part, ast.Name))
    return names


def _symbol_name(node: ast.AST) -> str | None:
    """The last name of a manifest path literal (``"module:Class.attr"`` or ``f"{_SCHED}.attr"``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr) and isinstance(node.values[-1], ast.Constant):
        text = str(node.values[-1].value)
    else:
        return None
    return text.replace(":", ".").rpartition(".")[2] or None


def manifest_names(decorator_attr: str) -> set[str]:
    """The names of the symbols the boundary modules list in ``MANIFEST.<decorator_attr>(...)`` calls."""
    names: set[str] = set()
    for module in BOUNDARY.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == decorator_attr:
                for symbol in node.args:
                    if isinstance(symbol, ast.Call) and symbol.args:
                        name = _symbol_name(symbol.args[0])
                        if name and not _is_dunder(name):
                            names.add(name)
    return names


# What kvreuse defines outside the boundary, and the boundary's functions (the adapters call them as attributes).
OWN = defined_names(PACKAGE) | {
    node.name for module in BOUNDARY.values() for node in module.tree.body if isinstance(node, ast.FunctionDef)
}
INTERNAL = manifest_names("touches")
INTERFACE = manifest_names("declare_interface")
AMBIGUOUS = sorted(name for name in INTERNAL if name in OWN or name in INTERFACE)
DISTINCTIVE = sorted(INTERNAL - set(AMBIGUOUS))


def uses(module: Module) -> list[tuple[int, str, str]]:
    """``(line, kind, name)`` of every attribute access and ``from ... import`` name of ``module``'s code."""
    found: list[tuple[int, str, str]] = []
    for node in runtime_nodes(module.tree):
        if isinstance(node, ast.Attribute):
            found.append((node.lineno, "attribute", node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            found.append((node.lineno, "attribute", node.args[1].value))
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("kvreuse"):
            found.extend((node.lineno, "import", alias.name) for alias in node.names)
    return found


def test_the_manifests_are_read():
    assert {"find_longest_cache_hit", "waiting_lora_adapters", "_registry", "_collector_to_names"} <= INTERNAL
    assert {"static_forward_context", "qkv_proj", "extract_layer_index", "match_kv_cache"} <= INTERNAL
    assert {"get_num_new_matched_tokens", "calc_priority"} <= INTERFACE
    # The names the grep can check are the internals' own; the ambiguous ones are few and known.
    assert set(AMBIGUOUS) <= {
        "block_size",
        # vLLM's model runner buffers the module recompute wrapper reads (vllm_0_32.remap_scheduled_tokens), named
        # like the fields of kvreuse's PagedBatch (after vLLM's attention metadata) and kvreuse's own positions
        "block_table",
        "device",
        "device_type",  # vLLM's DeviceConfig field (vllm_0_32.device_type), also torch's and kvreuse's word
        "free",
        "generate",  # AsyncLLM.generate, which the shadow copies wrap (vllm_0_32.shadow_requests); also LLM.generate
        "kv_cache_manager",
        "kv_transfer_params",  # an interface name the module connector also clears when it is not an object
        "max_tokens",
        "num_tokens",
        "page_size",
        "policy",
        "positions",
        "prefix_len",
        "query_start_loc",
        "register",
        # the wrapper's step order of requests (InputBatch), also kvreuse's own batch's fields and callbacks' names
        "num_reqs",
        "req_ids",
        "req_to_token_pool",
        "server_args",
        "shutdown",
        "skip_reading_prefix_cache",  # a SamplingParams field kvreuse sets, and the Request attribute it sets
        "token_to_kv_pool",
        "tokenizer",
        "vllm_config",
        # the Llama modules' attributes the pass of modules.recompute_blend reads (vllm_0_32.decoder_layers), named
        # like kvreuse's own model shapes, reference model and attention backends' methods
        "forward",
        "head_dim",
        "layers",
        "model",
        "num_heads",
        "num_kv_heads",
        "scaling",
    }, AMBIGUOUS
    assert "waiting" in DISTINCTIVE and "impl" in DISTINCTIVE


ENGINE_FACING = sorted(
    name
    for name, module in PACKAGE.items()
    if name.startswith(("kvreuse.vllm", "kvreuse.sglang")) or third_party_imports(module) & ENGINE_PACKAGES
)


@pytest.mark.parametrize("name", ENGINE_FACING)
def test_no_underscore_name_of_another_package(name):
    private = [
        f"line {line}: {kind} {attr}"
        for line, kind, attr in uses(PACKAGE[name])
        if attr.startswith("_") and not _is_dunder(attr) and (kind == "import" or attr not in OWN)
    ]
    assert private == [], f"{name} touches private names of an engine (move them into patches/): {private}"


@pytest.mark.parametrize("name", sorted(PACKAGE))
def test_no_engine_internal_outside_the_boundary(name):
    internal = [f"line {line}: {kind} {attr}" for line, kind, attr in uses(PACKAGE[name]) if attr in DISTINCTIVE]
    assert internal == [], f"{name} touches engine internals (use kvreuse.patches): {internal}"
