"""Who may write modules over a network, and what a write must look like (engine-free).

Reading (splicing) is open to every request; registering, replacing or dropping a module is a privileged write.
A server has one *module-write key*, an operator secret distinct from the engine's API keys, read from
``KVREUSE_MODULES_WRITE_KEY`` or from the file named by ``KVREUSE_MODULES_WRITE_KEY_FILE`` (:func:`load_write_key`);
without one, writes over the network are off. A client proves it holds the key with the header
:data:`WRITE_KEY_HEADER`, compared in constant time (:func:`key_matches`).

The front end that checked the key vouches for the write to the engine with :func:`write_proof`: an HMAC under
the key of everything the write does (:class:`WriteClaim`: name, context length, namespace, replace and probe
flags, and a digest of the prompt's token ids, so of the module's content and of the context it is encoded after),
an expiry and a random nonce. The engine, which never sees HTTP headers, can then tell a write the front end
allowed from one a client typed into ``kv_transfer_params`` itself (:data:`WRITE_PROOF` is the parameter that
carries it; a client-sent one is refused), and (:func:`check_proof`) refuses a proof for other content or another
write (the HMAC does not match), an expired one, and one it has accepted before (:class:`SeenNonces` remembers
each accepted nonce until its proof expires). A proof is a credential for one write: it is kept out of vLLM's
request log (``kvreuse.patches.vllm_0_32.redact_in_request_log``, :func:`redacted`).

The engine's own process tree writes without the key: whoever runs Python there (``vllm.LLM``, the offline
helpers of ``kvreuse.vllm.modules``) is the operator. The first kvreuse process of an engine (the one that parses
its arguments, before any engine process starts) puts a random *local secret* in its environment
(``kvreuse.config.share_local_secret``); the engine's processes inherit it, and the offline helpers sign their
writes with it (:func:`local_write_proof`). An HTTP client can neither read it nor make the server sign with it, so
a write that reaches the engine with a proof under neither key came from a client the front end did not vouch for
(the guard is not installed, or a client talks to the engine directly) and is refused (:func:`engine_write_keys`,
:func:`check_proof`).

Names are bounded: 1-128 characters from ``A-Z a-z 0-9 . _ : / @ + - #``, starting with a letter, digit or ``_``
(:func:`check_module_name`), so a name is safe to log and to put in a file name.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvreuse.config import LOCAL_SECRET_VARIABLE
from kvreuse.errors import ConfigError, ModuleRegistrationError

WRITE_KEY_VARIABLE = "KVREUSE_MODULES_WRITE_KEY"
WRITE_KEY_FILE_VARIABLE = "KVREUSE_MODULES_WRITE_KEY_FILE"
WRITE_KEY_HEADER = "x-kvreuse-module-key"
WRITE_PROOF = "kvreuse_write_proof"
MAX_NAME_LENGTH = 128
MIN_KEY_LENGTH = 16
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:/@+#\-]*")
# A proof is valid this long after it is made. The engine checks it when the request arrives (milliseconds after the
# guard or the offline API made it, since nothing queues before vLLM's scheduler adds a request); the margin covers
# an offline build that signs thousands of writes before the first reaches the engine.
PROOF_LIFETIME_S = 120
CLOCK_SKEW_S = 30  # an expiry further ahead than PROOF_LIFETIME_S + this is refused (the engine would remember it)
NONCE_CAPACITY = 1 << 16  # proofs an engine remembers at once: writes accepted within one lifetime (fails closed)
REDACTED = "[redacted]"
_PROOF_VERSION = "kvreuse-write-2"  # in every MAC: a proof of the earlier format never matches
_PROOF = re.compile(r"([0-9]{1,12})\.([0-9a-f]{32})\.([0-9a-f]{64})")  # expiry . nonce . HMAC-SHA256


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


def content_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of a prompt's token ids: what a write proof says the engine computes and stores."""
    return hashlib.sha256(",".join(str(int(token)) for token in token_ids).encode()).hexdigest()


@dataclass(frozen=True)
class WriteClaim:
    """Everything a write does, as a proof vouches for it: store the tokens after ``context`` of the prompt whose
    token ids have :func:`content_digest` ``content`` as module ``name`` of ``namespace`` (``replace``: replacing
    the entry under the name; ``probe``: rank the stored entry's tokens instead, ``kvreuse.modules.blend``)."""

    name: str
    context: int
    namespace: str
    replace: bool
    probe: bool
    content: str

    def message(self, expires: int, nonce: str) -> bytes:
        """The bytes a proof's HMAC covers: this claim, the expiry and the nonce."""
        fields = [_PROOF_VERSION, self.name, int(self.context), self.namespace, bool(self.replace), bool(self.probe)]
        return json.dumps([*fields, self.content, int(expires), nonce], separators=(",", ":")).encode()


def write_proof(key: str, claim: WriteClaim, *, now: float | None = None) -> str:
    """A proof of ``claim`` under ``key``: ``EXPIRY.NONCE.MAC`` (expiry in Unix seconds, :data:`PROOF_LIFETIME_S`
    from ``now``; a fresh random nonce; HMAC-SHA256 in hex of :meth:`WriteClaim.message`)."""
    expires = int(time.time() if now is None else now) + PROOF_LIFETIME_S
    nonce = secrets.token_hex(16)
    return f"{expires}.{nonce}.{_mac(key, claim.message(expires, nonce))}"


def _mac(key: str, message: bytes) -> str:
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def local_write_proof(claim: WriteClaim) -> str:
    """:func:`write_proof` of a write under this process tree's local secret (an offline write)."""
    secret = os.environ.get(LOCAL_SECRET_VARIABLE, "")
    if len(secret) < MIN_KEY_LENGTH:  # share_local_secret makes longer ones
        raise ConfigError(
            f"{LOCAL_SECRET_VARIABLE} is not set in this process: it is set when vLLM loads the kvreuse plugin, "
            f"before the engine starts; build the engine in this process with the plugin allowed (VLLM_PLUGINS)"
        )
    return write_proof(secret, claim)


class ProofVerdict(StrEnum):
    """What the engine makes of a write's proof (the refusals are labels of ``kvreuse:module_writes_refused_total``)."""

    VALID = "valid"
    UNPROVEN = "unproven"  # none, malformed, or not this write's under any engine key (other content, name, salt...)
    EXPIRED = "expired"  # this write's, but past its expiry (or dated further ahead than a proof lives)
    REPLAYED = "replayed"  # this write's, but its nonce was accepted before
    NONCES_FULL = "nonces_full"  # this write's, but the engine remembers NONCE_CAPACITY unexpired proofs already

    @property
    def why(self) -> str:
        """A sentence for the log."""
        return _WHY[self]


_WHY = {
    ProofVerdict.VALID: "the write proof is valid",
    ProofVerdict.UNPROVEN: (
        "it has no valid write proof for this write (none, malformed, made under no key of this engine, or made "
        "for other content, another name, context, namespace or flag); over HTTP, module writes need the "
        "module-write key through kvreuse.vllm.modules.guard.ModuleWriteGuard"
    ),
    ProofVerdict.EXPIRED: (
        f"its write proof has expired (proofs live {PROOF_LIFETIME_S} s; or the front end's clock is more than "
        f"{CLOCK_SKEW_S} s ahead of the engine's); send the write again through the guard"
    ),
    ProofVerdict.REPLAYED: "its write proof was used before (a proof is good for one write); send the write again",
    ProofVerdict.NONCES_FULL: (
        f"the engine already holds {NONCE_CAPACITY} unexpired write proofs (more writes than it can remember within "
        f"{PROOF_LIFETIME_S} s); retry later"
    ),
}


class SeenNonces:
    """The nonces of the proofs an engine accepted, each until its proof expires (a replay after that is refused
    as expired), at most ``capacity`` at once: memory is bounded, and a write past it is refused, never let
    through unremembered. Only proofs whose HMAC matched are remembered, so only key holders fill it."""

    def __init__(self, capacity: int = NONCE_CAPACITY) -> None:
        self.capacity = capacity
        self._expiry: dict[str, int] = {}
        self._queue: list[tuple[int, str]] = []  # (expiry, nonce), a heap: the next to forget first

    def __len__(self) -> int:
        return len(self._expiry)

    def admit(self, nonce: str, expires: int, now: float) -> ProofVerdict:
        """Remember ``nonce`` (valid until ``expires``) unless it was seen or memory is full; the verdict."""
        while self._queue and self._queue[0][0] <= now:
            del self._expiry[heapq.heappop(self._queue)[1]]
        if nonce in self._expiry:
            return ProofVerdict.REPLAYED
        if len(self._expiry) >= self.capacity:
            return ProofVerdict.NONCES_FULL
        self._expiry[nonce] = expires
        heapq.heappush(self._queue, (expires, nonce))
        return ProofVerdict.VALID


def check_proof(
    keys: Iterable[str], proof: object, claim: WriteClaim, seen: SeenNonces, *, now: float | None = None
) -> ProofVerdict:
    """Whether ``proof`` proves ``claim`` under one of ``keys``, now, for the first time (then its nonce is
    remembered in ``seen``). The HMAC is checked first (constant time), so a proof that is not a key holder's for
    this very write learns nothing more and leaves nothing in ``seen``."""
    parsed = _PROOF.fullmatch(proof) if isinstance(proof, str) else None
    if parsed is None:
        return ProofVerdict.UNPROVEN
    expires, nonce, mac = int(parsed[1]), parsed[2], parsed[3]
    message = claim.message(expires, nonce)
    if not any(hmac.compare_digest(mac, _mac(key, message)) for key in keys):
        return ProofVerdict.UNPROVEN
    now = time.time() if now is None else now
    if not now < expires <= now + PROOF_LIFETIME_S + CLOCK_SKEW_S:
        return ProofVerdict.EXPIRED
    return seen.admit(nonce, expires, now)


def redacted(params: Any) -> Any:
    """``kv_transfer_params`` as they may be logged: a copy with the write proof replaced by :data:`REDACTED`
    (anything else is returned as it is)."""
    if isinstance(params, Mapping) and WRITE_PROOF in params:
        return {**params, WRITE_PROOF: REDACTED}
    return params


def engine_write_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys an engine accepts write proofs under: the module-write key (writes the HTTP guard allowed) and
    the local secret (offline writes), those that are set."""
    environ = os.environ if environ is None else environ
    local = environ.get(LOCAL_SECRET_VARIABLE, "")
    return tuple(key for key in (load_write_key(environ), local if len(local) >= MIN_KEY_LENGTH else None) if key)
