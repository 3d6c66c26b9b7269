"""A row's prompt as a chat: what an instruct model needs to answer rather than continue the record.

An instruct model sent a raw record (``instruction``, then ``field: value`` lines) tends to continue it
(``"\\npick from:\\n* no\\n"``): it was trained on its chat template. So the front ends send each row's prompt as
the user turn of a chat, after an optional system turn, rendered by the model's own template (in process) or by
the server (``/v1/chat/completions``). The template's text before the user turn is the same for every row: a
shared prefix, which planning counts (:attr:`kvreuse.batch.PrefixCacheModel.prefix`); so is its text after the user
turn (the end of the turn and the assistant's header), which every prompt's count includes
(:attr:`kvreuse.batch.PrefixCacheModel.suffix`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvreuse.errors import ConfigError

# Stands for the user's text while a template is rendered to find what it puts before it (no template or row
# holds NUL characters and this exact text).
_MARK = "\x00kvreuse user turn\x00"


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One row's chat: the system turn (if any), then the row's prompt as the user turn."""
    user = {"role": "user", "content": prompt}
    return [user] if system is None else [{"role": "system", "content": system}, user]


def template_frame(render: Callable[[list[dict[str, str]]], str], system: str | None = None) -> tuple[str, str]:
    """The texts ``render`` (a chat template, with the generation prompt) puts before and after every user turn;
    ``("", "")`` where the template does not write the user's text verbatim (then planning counts the rows' own text
    alone)."""
    rendered = render(chat_messages(_MARK, system))
    head, found, tail = rendered.partition(_MARK)
    return (head, tail) if found else ("", "")


def check_system(system: object) -> str | None:
    """A system prompt as given: ``None`` or a non-empty string."""
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ConfigError(f"a system prompt must be non-empty text, not {system!r}")
    return system


def chat_choice(has_template: bool, chat: bool | None, system: object) -> tuple[bool, str | None]:
    """An in-process backend's ``(chat, system)``: ``chat=None`` sends chats where the model has a chat template,
    ``True`` refuses a model without one, ``False`` sends raw text; a system prompt (:func:`check_system`) needs
    chats."""
    if chat and not has_template:
        raise ConfigError(
            "the model has no chat template, so prompts cannot be sent as chats; send them raw (--raw, chat=False)"
        )
    chats = has_template if chat is None else chat
    checked = check_system(system)
    if checked is not None and not chats:
        raise ConfigError("a system prompt needs chat prompts; leave out --system (system=) with --raw")
    return chats, checked
