"""Settings of the SGLang adapter, and the names kvreuse adds to SGLang's own flags.

SGLang has no free-form configuration flag like vLLM's ``--additional-config``, so the plugins' settings
(``ReorderConfig``, ``SparseConfig``, ``ModulesConfig``) are read from their ``KVREUSE_<PLUGIN>_*`` environment
variables, which SGLang's scheduler processes inherit from the process that starts the server or ``Engine``.
What only the adapter needs is :class:`SGLangConfig` (``KVREUSE_SGLANG_*``).

The sparse attention backend and the module cache are switched on with SGLang's own flags, by names kvreuse
registers in SGLang's registries: ``--attention-backend kvreuse_sparse`` and ``--radix-cache-backend
kvreuse_modules``. The scheduling policies cannot be: ``--schedule-policy`` takes a fixed list of names that SGLang
0.5.23 offers no way to extend (its choices are rebuilt from the field's annotation each time the parser is made),
so they are chosen with ``KVREUSE_SGLANG_SCHEDULE_POLICY=prefix-affinity`` or ``module-sets``, which then takes the
place of whatever ``--schedule-policy`` names. That also keeps ``--enable-priority-scheduling`` usable: SGLang
accepts it only with ``--schedule-policy fcfs`` or ``lof``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreuse import config
from kvreuse.errors import ConfigError
from kvreuse.sglang.names import SchedulePolicyName


@dataclass(frozen=True)
class SGLangConfig:
    """What the SGLang adapter needs beyond the plugins' own settings (``KVREUSE_SGLANG_*``)."""

    schedule_policy: SchedulePolicyName = config.setting(
        SchedulePolicyName.SGLANG,
        "waiting-queue order in place of --schedule-policy: prefix-affinity (cached prefixes first, shared "
        "prefixes together, bounded waiting) or module-sets (neighbours share modules); empty = SGLang's own",
    )
    affinity_block: int = config.setting(
        16,
        "prefix-affinity: tokens that form the 'next block' two waiting requests must share to be grouped "
        "(rounded up to a multiple of --page-size)",
        low=1,
        high=1_000_000,
    )
    modules_file: str = config.setting(
        "",
        "module-sets and the module cache: a JSON file {name: [token ids]} of the prompt modules to "
        "recognise in requests (empty = none, or only those the module cache learns)",
    )

    @classmethod
    def load(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> SGLangConfig:
        return config.load(cls, "sglang", flags, environ)


def read_modules_file(path: str | Path) -> list[tuple[str, list[int]]]:
    """The modules of a ``KVREUSE_SGLANG_MODULES_FILE``: a JSON object ``{name: [token ids]}``, in file order.

    Token ids (not text) because SGLang's scheduler process has no tokenizer of its own; make them with the served
    model's tokenizer, e.g. ``{name: tokenizer(text, add_special_tokens=False)["input_ids"]}``.
    """
    where = f"sglang.modules_file ({config.env_name('sglang', 'modules_file')}) {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: cannot be read as JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a JSON object {{name: [token ids]}}, got {type(data).__name__}")
    modules = []
    for name, ids in data.items():
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            raise ConfigError(f"{where}: module {name!r} must be a non-empty list of token ids (integers >= 0)")
        modules.append((name, ids))
    return modules
