"""Stop strings are cut exactly, even across token boundaries, and nothing past them is sent."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatTokenizer
from router.text_stream import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return ChatTokenizer.from_dir(tiny_model_dir)


def feed(stream, tokenizer, text):
    out = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        out.append(stream.add([token_id]))
        if stream.stopped:
            break
    else:
        out.append(stream.flush())
    return "".join(out)


@pytest.mark.parametrize("stop, expected", [
    (["sat on"], "the cat "),
    (["t s"], "the ca"),          # spans two words, so two tokens
    (["zzz", "mat"], "the cat sat on the "),
    (["nowhere"], "the cat sat on the mat"),
    ([], "the cat sat on the mat"),
])
def test_stop_strings_cut_exactly(tokenizer, stop, expected):
    stream = TextStream(tokenizer, stop)
    assert feed(stream, tokenizer, "the cat sat on the mat") == expected
    assert stream.stopped == (expected != "the cat sat on the mat")


def test_text_is_not_held_back_without_a_possible_stop(tokenizer):
    stream = TextStream(tokenizer, ["xyz"])
    first = stream.add(tokenizer.encode("the cat", add_special_tokens=False))
    assert first == "the c"  # only the last len("xyz") - 1 characters wait to see if "xyz" follows
