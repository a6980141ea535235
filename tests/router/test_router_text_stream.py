"""Stop strings are cut exactly, even across token boundaries, and nothing past them is sent."""

from __future__ import annotations

import pytest

from engine.tokenizer import ChatTokenizer, IncrementalDetokenizer
from router.text_stream import TextStream, WindowDetokenizer


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


MULTILINGUAL = ("Grüße aus Köln — naïve café. 日本語のテキスト、中文文本。 Ελληνικά, русский текст, "
                "עברית, العربية, हिन्दी 🙂👍🏽 emoji and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok")


def llama2_style_tokenizer() -> ChatTokenizer:
    """A SentencePiece-like tokenizer (Metaspace pieces, byte fallback, leading space stripped):
    its decoder treats the first token differently, unlike the byte-level BPE of the demo model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "▁cat", "▁aus", "s", "e", "t", "▁G"]
    tokenizer = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                                     byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return ChatTokenizer(tokenizer.to_str())


@pytest.mark.parametrize("kind", ["byte_level", "llama2_style"])
@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("window_tokens", [1, 4, 32])
def test_window_detokenizer_matches_a_full_decode(tokenizer, kind, step, window_tokens):
    tok = tokenizer if kind == "byte_level" else llama2_style_tokenizer()
    ids = tok.encode(MULTILINGUAL, add_special_tokens=False)
    assert tok.decode(ids) == MULTILINGUAL and len(ids) > 100  # long enough for the window to move
    window = WindowDetokenizer(tok, window_tokens=window_tokens)
    full = IncrementalDetokenizer(tok)  # the reference: decodes every id at every step
    text = ""
    for i in range(0, len(ids), step):
        delta = window.add(ids[i:i + step])
        assert delta == full.add(ids[i:i + step]), i  # the same delta at every step, not just in the end
        text += delta
    assert text == MULTILINGUAL


def test_text_stream_skips_special_tokens_like_a_full_decode(tokenizer):
    eos = tokenizer.token_to_id(tokenizer.eos_token)
    ids = tokenizer.encode("naïve 日本", add_special_tokens=False)
    stream = TextStream(tokenizer, [])
    text = "".join(stream.add([token_id]) for token_id in ids[:2] + [eos] + ids[2:]) + stream.flush()
    assert text == tokenizer.decode(ids[:2] + [eos] + ids[2:]) == "naïve 日本"


@pytest.mark.parametrize("stop", [[], ["xyz"]])
@pytest.mark.parametrize("text", ["ok 日本", "日"])
def test_a_character_cut_by_the_last_token_ends_the_text_as_a_full_decode_does(tokenizer, stop, text):
    """A generation that ends (max_tokens) inside a multi-byte character still shows what it produced:
    the replacement character a full decode gives, not an answer missing its last tokens (or empty)."""
    cut = tokenizer.encode(text, add_special_tokens=False)[:-1]
    expected = tokenizer.decode(cut)
    assert expected.endswith("\ufffd")
    stream = TextStream(tokenizer, stop)
    assert "".join(stream.add([token_id]) for token_id in cut) + stream.flush() == expected
    assert stream.text == expected


BARE_CALL = "<function=now>\n<parameter=zone>\nutc}\n</parameter>\n</function>"


@pytest.mark.parametrize("fmt_name", ["qwen3_coder", "seed_oss"])
@pytest.mark.parametrize("stop, called, expected", [
    (["utc", "}"], "now", "Let me check. " + BARE_CALL),              # in the arguments: the call is whole
    (["<func", "=now"], "now", "Let me check. " + BARE_CALL),         # in the call's opening, token by token
    (["check."], "now", "Let me "),                                   # in the words before it: cut there
    (["utc"], "rm", "Let me check. <function=rm>\n<parameter=zone>\n"),  # a function not offered: words, cut
])
def test_a_stop_string_does_not_cut_a_call_written_without_its_marker(tokenizer, fmt_name, stop, called, expected):
    """Qwen3-Coder and Seed-OSS sometimes write a call as a bare `<function=NAME>` (no `<tool_call>`); where the
    request offers NAME it is a call, and the stop strings, which end words, stop looking where it opens."""
    from router.tool_calls import FORMATS
    text = "Let me check. " + BARE_CALL.replace("=now>", f"={called}>")
    stream = TextStream(tokenizer, stop, calls=FORMATS[fmt_name], names=frozenset({"now", "write"}))
    assert feed(stream, tokenizer, text) == expected
    assert stream.stopped == (expected != text)
