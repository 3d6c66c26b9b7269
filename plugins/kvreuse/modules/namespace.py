"""Namespaces of modules: the global one, and one per tenant keyed by the engine's cache salt.

A request splices the global modules and those of its own salt, never another tenant's (vLLM's and SGLang's
``cache_salt`` isolate their prefix caches the same way). A request without a salt sees the global modules only.
The salt is a tenant's secret: it is kept in memory to key the namespace but never logged or exported; logs and
figures name a namespace by :func:`namespace_label`.
"""

from __future__ import annotations

import hashlib

from kvreuse.errors import ModuleRegistrationError

GLOBAL = ""  # the namespace every request sees; an empty or missing salt means this one


def namespace_of(salt: str | None) -> str:
    """The namespace a request with cache salt ``salt`` writes to (``None`` or ``""``: the global one)."""
    if salt is None:
        return GLOBAL
    if not isinstance(salt, str):
        raise ModuleRegistrationError(f"a cache salt must be a string, got {type(salt).__name__}")
    return salt


def namespace_label(namespace: str) -> str:
    """A name for logs and figures that does not reveal the salt: ``global`` or ``tenant-<8 hex digits>``."""
    if namespace == GLOBAL:
        return "global"
    return "tenant-" + hashlib.sha256(namespace.encode()).hexdigest()[:8]
