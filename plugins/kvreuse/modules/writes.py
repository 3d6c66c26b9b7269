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

Names are bounded: 1-128 characters from ``A-Z a-z 0-9 . _ : / @ + -``, starting with a letter or digit
(:func:`check_module_name`), so a name is safe to log and to put in a file name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from kvreuse.errors import ConfigError, ModuleRegistrationError

WRITE_KEY_VARIABLE = "KVREUSE_MODULES_WRITE_KEY"
WRITE_KEY_FILE_VARIABLE = "KVREUSE_MODULES_WRITE_KEY_FILE"
WRITE_KEY_HEADER = "x-kvreuse-module-key"
WRITE_PROOF = "kvreuse_write_proof"
MAX_NAME_LENGTH = 128
MIN_KEY_LENGTH = 16
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+\-]*")


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
            "a module name starts with a letter or digit and uses only letters, digits and . _ : / @ + - "
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
