"""The names a user types to switch kvreuse's plugins on in SGLang.

Imported in every SGLang process by ``register()``, so it imports nothing.
"""

from __future__ import annotations

from enum import StrEnum


class BackendName(StrEnum):
    """Values kvreuse adds to SGLang's own flags (SGLang's backends are named with ``_``)."""

    SPARSE_ATTENTION = "kvreuse_sparse"  # --attention-backend
    MODULE_CACHE = "kvreuse_modules"  # --radix-cache-backend


class SchedulePolicyName(StrEnum):
    """``KVREUSE_SGLANG_SCHEDULE_POLICY`` values (spelt like SGLang's own policy names)."""

    SGLANG = ""  # SGLang's own --schedule-policy
    PREFIX_AFFINITY = "prefix-affinity"
    MODULE_SETS = "module-sets"
