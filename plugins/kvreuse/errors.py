"""kvreuse's own exception types.

Every error a user can cause (a bad flag, a malformed table, an unsupported model) is raised as one of these,
with a message that names the thing to fix. Internal invariants may still use ``assert``.
"""


class KVReuseError(Exception):
    """Base class of every error kvreuse raises on purpose."""


class ConfigError(KVReuseError, ValueError):
    """A setting (engine flag or ``KVREUSE_*`` variable) has a value outside its accepted range."""


class TableError(KVReuseError, ValueError):
    """A table given to a front end cannot be turned into requests (unknown field, duplicate field, ...)."""


class BackendError(KVReuseError, RuntimeError):
    """A backend could not answer: the server is unreachable or rejected a request, or it broke the contract."""


class EngineVersionError(KVReuseError, RuntimeError):
    """An engine version that a patch or adapter was not written for."""


class KernelArgumentError(KVReuseError, ValueError):
    """A tensor handed to a kvreuse kernel has the wrong shape, dtype, device or layout."""


def check_kernel_argument(ok: bool, message: str) -> None:
    """Raise :class:`KernelArgumentError` with ``message`` (which names the tensor) unless ``ok``."""
    if not ok:
        raise KernelArgumentError(message)


class UnsupportedPositionalEncoding(KVReuseError, ValueError):
    """A model's positional encoding cannot be re-applied to cached keys (so its modules cannot move)."""


class RerotationMismatch(KVReuseError, RuntimeError):
    """The start-up check found that rotating twice differs from rotating once.

    See ``kvreuse.kernels.rerotate.check_rerotation``.
    """


class PMLError(KVReuseError, ValueError):
    """A PML schema or prompt is malformed or refers to something that does not exist; says where (line, column)."""

    def __init__(self, message: str, line: int, column: int):
        super().__init__(f"line {line}, column {column}: {message}")
        self.reason, self.line, self.column = message, line, column


class UnknownTable(KVReuseError, LookupError):
    """A table asked for is not in the database's schema (or the database is not known)."""

    def __str__(self) -> str:  # LookupError would quote the message
        return str(self.args[0])


class ModuleRegistrationError(KVReuseError, ValueError):
    """A module cannot be registered: empty, or the same token ids as another module under another name."""


class ModuleConflict(ModuleRegistrationError):
    """A module name is already stored with other content (tokens, context, recovery); replacing it is explicit."""


class ModuleIndexFull(ModuleRegistrationError):
    """Registering a module would take the token index past its memory budget (``modules.index_bytes``)."""


class ModuleMismatch(ModuleRegistrationError):
    """A module was encoded for another model or tokenizer than the store serves, or its key does not match it."""


class ModuleTooLarge(KVReuseError, ValueError):
    """A module is larger than the capacity of every tier of the store."""


class ModuleQuotaExceeded(ModuleTooLarge):
    """A tenant's module is larger than its namespace's quota (``modules.namespace_bytes``), or no tier has room
    for it that protected global modules do not hold (``modules.protect_global``)."""


class RequestParameterError(KVReuseError, ValueError):
    """A request's own kvreuse parameter (in its ``kv_transfer_params``) is malformed or out of its range; ``field``
    names it (``kv_transfer_params.kvreuse_ape.temperature``)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
