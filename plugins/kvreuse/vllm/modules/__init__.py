"""The ``modules`` plugin in vLLM: the KV connector ``KVReuseModuleCache`` and the functions that feed it.

* ``connector``: the connector class vLLM builds (a thin facade), over ``scheduler`` (which prompt tokens come from
  modules, in vLLM's engine-core process) and ``worker`` (the module store and the KV copies, in each worker);
  ``common`` holds what crosses between them, ``metrics`` their counters;
* ``encode`` (re-exported here): putting modules into a running engine and building prompts that use them;
* ``calibrate`` (``calibrate_modules`` re-exported here): the cheapest recompute setting that keeps an agreement
  floor with full prefill on a sample of the user's prompts.
"""

from __future__ import annotations

from kvreuse.vllm.modules.calibrate import calibrate_modules
from kvreuse.vllm.modules.common import encode_params
from kvreuse.vllm.modules.encode import (
    SPECIAL_PREFIX,
    encode_database,
    encode_modules,
    encode_schema,
    module_token_ids,
    pml_prompt,
    schema_layout,
    special_prefix,
)

__all__ = [
    "SPECIAL_PREFIX",
    "calibrate_modules",
    "encode_database",
    "encode_modules",
    "encode_params",
    "encode_schema",
    "module_token_ids",
    "pml_prompt",
    "schema_layout",
    "special_prefix",
]
