"""Who may write modules over a network, and what a write must look like (engine-free).

Reading (splicing) is open to every request; registering, replacing or dropping a module is a privileged write.
A server has one *module-write key*, an operator secret distinct from the engine's API keys, read from
``KVREUSE_MODULES_WRITE_KEY`` or from the file named by ``KVREUSE_MODULES_WRITE_KEY_FILE`` (:func:`load_write_key`);
without one, writes over the network are off. A client proves it holds the key with the header
:data:`WRITE_KEY_HEADER`, compared in constant time (:func:`key_matches`).

The front end that checked the key vouches for the write to the engine with :func:`write_proof`, an HMAC of the
write's name, context length, namespace and replace flag under the key: the engine, which never sees HTTP headers,
can then tell a write the front end allowed from one a client typed into ``kv_transfer_params`` itself
(:data:`WRITE_PROOF` is the parameter that carries it; a client-sent one is refused).

The engine's own process tree writes without the key: whoever runs Python there (``vllm.LLM``, the offline
helpers of ``kvreuse.vllm.modules``) is the operator. The first kvreuse process of an engine (the one that parses
its arguments, before any engine process starts) puts a random *local secret* in its environment
(``kvreuse.config.share_local_secret``); the engine's processes inherit it, and the offline helpers sign their
writes with it (:func:`local_write_proof`). An HTTP client can neither read it nor make the server sign with it, so
a write that reaches the engine with a proof under neither key came from a client the front end did not vouch for
(the guard is not installed, or a client talks to the engine directly) and is refused (:func:`engine_write_keys`,
:func:`proven`).

Names are bounded: 1-128 characters from ``A-Z a-z 0-9 . _ : / @ + - #``, starting with a letter, digit or ``_``
(:func:`check_module_name`), so a name is safe to log and to put in a file name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvreuse.config import LOCAL_SECRET_VARIABLE
from kvreuse.errors import ConfigError, ModuleRegistrationError

WRITE_KEY_VARIABLE = "KVREUSE_MODULES_WRITE_KEY"
WRITE_KEY_FILE_VARIABLE = "KVREUSE_MODULES_WRITE_KEY_FILE"
WRITE_KEY_HEADER = "x-kvreuse-module-key"
WRITE_PROOF = "kvreuse_write_proof"
MAX_NAME_LENGTH = 128
MIN_KEY_LENGTH = 16
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:/@+#\-]*")


def load_write_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The module-write key from the environment (the variable, else the file it names), or ``None`` (writes off).

    Raises :class:`ConfigError` for an unreadable file or a key shorter than 16 characters (guessable).
    """
    environ = os.environ if environ is None else environ
    key = environ.get(WRITE_KEY_VARIABLE, "")
    if not key and environ.get(WRITE_KEY_FILE_VARIABLE):
        path = Path(environ[WRITE_KEY_FILE_VARIABLE])
        try:
            key = path.read_text().strip()
        except OSError as why:
            raise ConfigError(f"{WRITE_KEY_FILE_VARIABLE}: cannot read {path}: {why.strerror}") from None
    if not key:
        return None
    if len(key) < MIN_KEY_LENGTH:
        raise ConfigError(
            f"{WRITE_KEY_VARIABLE}: the module-write key has {len(key)} characters; use at least {MIN_KEY_LENGTH} "
            f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return key


def key_matches(given: str | None, key: str) -> bool:
    """Whether ``given`` is ``key``, in time that does not depend on where they differ (nor on their lengths)."""
    if given is None:
        return False
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(key.encode()).digest())


def check_module_name(name: object) -> str:
    """``name`` if it is a valid module name; :class:`ModuleRegistrationError` saying what is wrong otherwise."""
    if not isinstance(name, str):
        raise ModuleRegistrationError(f"a module name must be a string, got {type(name).__name__}")
    if not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise ModuleRegistrationError(f"a module name has 1-{MAX_NAME_LENGTH} characters, this one has {len(name)}")
    if not _NAME.fullmatch(name):
        raise ModuleRegistrationError(
            "a module name starts with a letter, digit or _ and uses only letters, digits and . _ : / @ + - # "
            f"(got {name[:32]!r}{'...' if len(name) > 32 else ''})"
        )
    return name


def write_proof(key: str, name: str, context: int, namespace: str, replace: bool) -> str:
    """HMAC-SHA256 (hex) under ``key`` of the write's name, context length, namespace and replace flag."""
    message = json.dumps([name, int(context), namespace, bool(replace)], separators=(",", ":")).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(key: str, proof: object, name: str, context: int, namespace: str, replace: bool) -> bool:
    """Whether ``proof`` is :func:`write_proof` of this write under ``key`` (constant time)."""
    if not isinstance(proof, str):
        return False
    return hmac.compare_digest(proof, write_proof(key, name, context, namespace, replace))


def local_write_proof(name: str, context: int, namespace: str, replace: bool) -> str:
    """:func:`write_proof` of a write under this process tree's local secret (an offline write)."""
    secret = os.environ.get(LOCAL_SECRET_VARIABLE, "")
    if len(secret) < MIN_KEY_LENGTH:  # share_local_secret makes longer ones
        raise ConfigError(
            f"{LOCAL_SECRET_VARIABLE} is not set in this process: it is set when vLLM loads the kvreuse plugin, "
            f"before the engine starts; build the engine in this process with the plugin allowed (VLLM_PLUGINS)"
        )
    return write_proof(secret, name, context, namespace, replace)


def engine_write_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys an engine accepts write proofs under: the module-write key (writes the HTTP guard allowed) and
    the local secret (offline writes), those that are set."""
    environ = os.environ if environ is None else environ
    local = environ.get(LOCAL_SECRET_VARIABLE, "")
    return tuple(key for key in (load_write_key(environ), local if len(local) >= MIN_KEY_LENGTH else None) if key)


def proven(keys: Iterable[str], proof: object, name: str, context: int, namespace: str, replace: bool) -> bool:
    """Whether ``proof`` is the write's proof under one of ``keys``."""
    return any(proof_matches(key, proof, name, context, namespace, replace) for key in keys)
