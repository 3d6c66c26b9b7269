"""SGLang adapter: thin classes that translate between SGLang's interfaces and kvreuse's engine-free cores.

SGLang loads ``register`` (entry point group ``sglang.srt.plugins``) in each of its processes, so this module
imports nothing of SGLang itself; the adapters are imported when SGLang builds them:

* ``kvreuse.sglang.scheduler``: the schedule policy (``KVREUSE_SGLANG_SCHEDULE_POLICY``) over
  ``kvreuse.reorder``;
* ``kvreuse.sglang.attention``: the sparse attention backend (``--attention-backend kvreuse_sparse``) over
  ``kvreuse.sparse`` and the kernels;
* ``kvreuse.sglang.module_cache``: the module cache (``--radix-cache-backend kvreuse_modules``) over
  ``kvreuse.modules`` and the rerotation kernel;
* ``kvreuse.sglang.backend``: the batch front ends' backend on an in-process ``sglang.Engine``.
"""

from __future__ import annotations

from kvreuse.sglang.registration import register, registered_pids

__all__ = ["register", "registered_pids"]
