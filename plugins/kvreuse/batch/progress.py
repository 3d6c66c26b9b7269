"""What a batch job has done so far: running totals, and the progress bar that shows them.

The bar (tqdm, on standard error) shows rows done of all rows, rows per second, the share of prompt tokens the
engine served from its prefix cache and the rows it refused, updated as each answer arrives. While it is drawn,
log lines on standard error (an in-process engine's) are written above it, not into it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from tqdm import tqdm

from kvreuse.batch.backend import Completion


@dataclass
class Tally:
    """Running totals over the completions of a job.

    Token counts are summed over answered rows; a count is ``None`` once any answered row did not report it (a hit
    rate from part of the rows would mislead). Refused rows (``Completion.error``) are counted in ``errors``.
    """

    requests: int = 0
    errors: int = 0
    prompt_tokens: int | None = 0
    cached_tokens: int | None = 0

    def add(self, completion: Completion) -> None:
        self.requests += 1
        if completion.error is not None:
            self.errors += 1
            return
        self.prompt_tokens = _plus(self.prompt_tokens, completion.prompt_tokens)
        self.cached_tokens = _plus(self.cached_tokens, completion.cached_tokens)

    @property
    def hit_rate(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens


def _plus(total: int | None, count: int | None) -> int | None:
    return None if total is None or count is None else total + count


class JobProgress:
    """A tqdm bar over ``total`` rows (``done`` of them answered by an earlier run), with hit rate and errors.

    ``enabled=False`` keeps the totals and draws nothing. Use as a context manager.
    """

    def __init__(self, total: int, *, done: int = 0, enabled: bool = True, desc: str = "rows") -> None:
        self.tally = Tally()
        self._bar = tqdm(
            total=total, initial=done, desc=desc, unit="row", file=sys.stderr, disable=not enabled, dynamic_ncols=True
        )
        self._moved = _log_above_bar() if enabled else []

    def add(self, completion: Completion) -> None:
        """Count one answered (or refused) row."""
        self.tally.add(completion)
        rate = self.tally.hit_rate
        hit = "n/a" if rate is None else f"{rate:.1%}"
        self._bar.set_postfix_str(f"hit {hit}, errors {self.tally.errors}", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        for handler in self._moved:
            handler.setStream(sys.stderr)
        self._moved = []
        self._bar.close()

    def __enter__(self) -> JobProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _AboveTheBar:
    """A stream that writes each line with ``tqdm.write``: the bar is cleared, the line written, the bar drawn."""

    def write(self, text: str) -> int:
        if text.strip():
            tqdm.write(text.rstrip("\n"), file=sys.stderr)
        return len(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _log_above_bar() -> list[logging.StreamHandler]:
    """Point every logging handler that writes to standard error at :class:`_AboveTheBar`; the handlers moved
    (their filters and formats stay theirs)."""
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    moved = []
    for logger in loggers:
        for handler in logger.handlers:
            settable = not isinstance(getattr(type(handler), "stream", None), property)  # logging's last resort
            to_stderr = isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__)
            if settable and to_stderr:
                handler.setStream(_AboveTheBar())  # type: ignore[arg-type]
                moved.append(handler)
    return moved
