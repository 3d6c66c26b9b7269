"""Chat prompts: a row's prompt as the user turn, and the text a chat template puts around every user turn."""

from __future__ import annotations

import pytest

from kvreuse.batch.chat import chat_choice, chat_messages, check_system, template_frame
from kvreuse.errors import ConfigError


def chatml(messages: list[dict[str, str]]) -> str:
    """A ChatML template with a default system turn, as SmolLM2's writes it, and the generation prompt."""
    turns = messages if messages[0]["role"] == "system" else [{"role": "system", "content": "Be helpful."}, *messages]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns) + "<|im_start|>assistant\n"


def test_a_rows_prompt_is_the_user_turn_after_an_optional_system_turn():
    assert chat_messages("Q\n\na: 1\n") == [{"role": "user", "content": "Q\n\na: 1\n"}]
    assert chat_messages("Q", "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q"},
    ]


def test_the_template_frame_is_everything_before_and_after_the_user_turn():
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    assert template_frame(chatml) == ("<|im_start|>system\nBe helpful.<|im_end|>\n<|im_start|>user\n", tail)
    assert template_frame(chatml, "Be brief.") == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n", tail)


def test_a_template_that_rewrites_the_users_text_has_no_frame_to_plan_on():
    assert template_frame(lambda messages: messages[-1]["content"].strip().upper()) == ("", "")


@pytest.mark.parametrize("system", ["", "  ", 3])
def test_a_system_prompt_must_be_non_empty_text(system):
    with pytest.raises(ConfigError, match="a system prompt must be non-empty text"):
        check_system(system)


def test_an_in_process_backend_chats_where_the_model_has_a_template_unless_told_otherwise():
    assert chat_choice(True, None, None) == (True, None)
    assert chat_choice(False, None, None) == (False, None)
    assert chat_choice(True, False, None) == (False, None)
    assert chat_choice(True, None, "Be brief.") == (True, "Be brief.")
    with pytest.raises(ConfigError, match="the model has no chat template"):
        chat_choice(False, True, None)
    with pytest.raises(ConfigError, match="a system prompt needs chat prompts"):
        chat_choice(False, None, "Be brief.")
    with pytest.raises(ConfigError, match="a system prompt must be non-empty text"):
        chat_choice(True, None, " ")
