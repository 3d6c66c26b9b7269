"""Which stored encoding of a module a prompt takes (``kvreuse.modules.encodings``): by adapter, then by context."""

from __future__ import annotations

from kvreuse.modules.encodings import Choice, Encoding, EncodingMatch, choose_encoding, context_fits

HEADER = (1, 2, 3)
NEIGHBOUR = (7, 8)


def encoding(key, context=(), adapter="", primary=False, version=0, start=None):
    return Encoding(key, adapter, tuple(context), len(context) if start is None else start, primary, version)


def at_end(before):
    """A prompt of ``before`` then a module of three tokens, and the module's position."""
    return (*before, 100, 101, 102), len(before)


def test_a_context_fits_when_it_is_the_prompts_start_and_the_tokens_right_before_the_module():
    before = (*HEADER, 4, 5, 6, *NEIGHBOUR)
    prompt, at = (*before, 10, 11, 12), len(before)  # the module's tokens 10, 11, 12 at position 8
    assert context_fits((), prompt, at)
    assert context_fits(HEADER, prompt, at)  # after the header
    assert context_fits(NEIGHBOUR, prompt, at)  # after its neighbour
    assert context_fits((*HEADER, *NEIGHBOUR), prompt, at)  # both, the middle missing
    assert context_fits(before, prompt, at)
    assert not context_fits((*HEADER, 4, *NEIGHBOUR), (*HEADER, 5, *NEIGHBOUR), 6)  # a token it saw is not there
    assert not context_fits((4, 5), prompt, at)  # tokens of the middle, seen at other positions
    assert not context_fits((*before, 9), prompt, at)  # longer than what precedes the module
    assert not context_fits((8, 7), prompt, at)
    assert not context_fits((10, 11), prompt, at)  # the module's own tokens are not before it


def test_an_exact_encoding_wins_then_the_longest_fitting_context_then_the_names_first():
    alone = encoding("alone", primary=True, version=1)
    header = encoding("header", HEADER, version=2)
    both = encoding("both", (*HEADER, *NEIGHBOUR), version=3)
    hostile = encoding("hostile", (6, 6, 6, 6, 6, 6), version=4)
    stored = [hostile, both, header, alone]
    # The module right after the header: the header's encoding is a full prefill's KV there.
    assert choose_encoding(stored, *at_end(HEADER), "") == Choice("header", EncodingMatch.EXACT, 3)
    # Later in the prompt, after its neighbour: the encoding that saw the header and the neighbour.
    assert choose_encoding(stored, *at_end((*HEADER, 4, 5, *NEIGHBOUR)), "") == Choice("both", EncodingMatch.CONTEXT, 5)
    assert choose_encoding(stored, *at_end((*HEADER, 4, 5)), "") == Choice("header", EncodingMatch.CONTEXT, 3)
    # A prompt that does not start with the header: alone, never the hostile context's.
    assert choose_encoding(stored, *at_end((9, 9)), "") == Choice("alone", EncodingMatch.ALONE, 0)
    assert choose_encoding(stored, *at_end(()), "") == Choice("alone", EncodingMatch.EXACT, 0)
    # The hostile encoding is taken only where the prompt holds its context, where it is exact.
    assert choose_encoding(stored, *at_end((6,) * 6), "") == Choice("hostile", EncodingMatch.EXACT, 6)


def test_an_encoding_whose_context_does_not_fit_is_taken_only_as_the_names_first():
    referenced = encoding("after-refs", (4, 5, 6), primary=True, version=1)
    hostile = encoding("hostile", (6, 6), version=2)
    assert choose_encoding([hostile, referenced], *at_end((9, 9, 9)), "") == Choice(
        "after-refs", EncodingMatch.UNMATCHED, 0
    )
    assert choose_encoding([hostile], *at_end((9, 9, 9)), "") is None  # its first encoding left: nothing is spliced


def test_only_the_requests_own_adapter_is_taken():
    base = encoding("base", primary=True)
    lora = encoding("lora", adapter="lora:x", primary=True)
    assert choose_encoding([base, lora], *at_end(()), "lora:x").key == "lora"
    assert choose_encoding([base, lora], *at_end(()), "").key == "base"
    assert choose_encoding([base], *at_end(()), "lora:x") is None  # no encoding computed with that adapter
    assert choose_encoding([lora], *at_end((5,)), "") is None


def test_the_choice_does_not_depend_on_the_order_encodings_are_listed():
    stored = [
        encoding("a", HEADER, version=2),
        encoding("b", HEADER, version=3),
        encoding("first", primary=True, version=1),
        encoding("c", NEIGHBOUR, version=4),
    ]
    before = (*HEADER, *NEIGHBOUR)
    choices = {choose_encoding(order, *at_end(before), "") for order in (stored, stored[::-1], stored[1:] + stored[:1])}
    assert choices == {Choice("a", EncodingMatch.CONTEXT, 3)}  # equally long: the oldest
