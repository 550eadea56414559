"""Incremental detokenization and stop conditions, on the tiny models' byte-level tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from decode_service.detokenizer import IncrementalDetokenizer
from decode_service.stopping import Generation, TokenOutput
from tests.stack_fixtures import model_dir

EOS = 999  # not a real token: never decoded


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(model_dir("qwen2"), local_files_only=True)


def ids(text: str) -> list[int]:
    return list(text.encode())  # the tiny tokenizers map byte b to token id b


def gen(tokenizer: Any, max_tokens: int = 100, stop: tuple[str, ...] = (), ignore_eos: bool = False) -> Generation:
    return Generation(tokenizer, ids("Q: "), max_tokens, frozenset({EOS}), stop=stop, ignore_eos=ignore_eos)


def feed(g: Generation, token_ids: list[int]) -> list[TokenOutput]:
    out = []
    for t in token_ids:
        out.append(g.accept(t))
        if g.finished:
            break
    return out


def test_multibyte_characters_are_released_whole(tokenizer: Any) -> None:
    d = IncrementalDetokenizer(tokenizer, ids("x"))
    pieces = [d.add(t) for t in ids("é€😀a")]
    assert pieces == ["", "é", "", "", "€", "", "", "", "😀", "a"]
    assert d.flush() == ""


def test_an_incomplete_character_is_flushed_at_the_end(tokenizer: Any) -> None:
    g = gen(tokenizer, max_tokens=3)
    outs = feed(g, ids("a€"))  # 'a' then 2 of the 3 bytes of '€'
    assert [o.text for o in outs] == ["a", "", "\ufffd"]
    assert outs[-1].finish_reason == "length" and g.text == "a\ufffd"


def test_text_streams_and_stops_at_max_tokens(tokenizer: Any) -> None:
    g = gen(tokenizer, max_tokens=5)
    outs = feed(g, ids("hello world"))
    assert "".join(o.text for o in outs) == "hello" == g.text
    assert g.finish_reason == "length" and g.token_ids == ids("hello")


def test_eos_ends_the_generation_unless_ignored(tokenizer: Any) -> None:
    g = gen(tokenizer)
    outs = feed(g, [*ids("hi"), EOS, *ids("more")])
    assert g.finish_reason == "eos" and g.token_ids == [*ids("hi"), EOS] and g.text == "hi"
    assert outs[-1] == TokenOutput(EOS, "", "eos")
    g = gen(tokenizer, max_tokens=4, ignore_eos=True)
    feed(g, [*ids("hi"), EOS, *ids("more")])
    assert g.finish_reason == "length" and g.token_ids == [*ids("hi"), EOS, ord("m")]


def test_stop_string_truncates_the_text_and_holds_back_its_prefix(tokenizer: Any) -> None:
    g = gen(tokenizer, stop=("\n\n", "END"))
    outs = feed(g, ids("ab\ncd\n\nignored"))
    streamed = "".join(o.text for o in outs)
    assert streamed == g.text == "ab\ncd"
    assert g.finish_reason == "stop"
    assert g.token_ids == ids("ab\ncd\n\n")  # up to the token that completed the stop string
    # the first '\n' was held back until 'c' showed it was not the start of '\n\n'
    assert [o.text for o in outs[:4]] == ["a", "b", "", "\nc"]


def test_stop_string_across_a_multibyte_character(tokenizer: Any) -> None:
    g = gen(tokenizer, stop=("€!",))
    feed(g, ids("x€!y"))
    assert g.text == "x" and g.finish_reason == "stop"


def test_held_back_text_is_released_when_the_generation_ends(tokenizer: Any) -> None:
    g = gen(tokenizer, max_tokens=3, stop=("END",))
    outs = feed(g, ids("aEN"))
    assert [o.text for o in outs] == ["a", "", "EN"] and g.text == "aEN" and g.finish_reason == "length"


def test_stop_string_in_the_first_token(tokenizer: Any) -> None:
    g = gen(tokenizer, stop=("!",))
    outs = feed(g, ids("!x"))
    assert outs == [TokenOutput(ord("!"), "", "stop")] and g.text == ""


@pytest.mark.parametrize(("text", "stop", "max_tokens"), [
    ("ab\ncd\n\nignored", ("\n\n", "END"), 20),  # ends on a stop string; '\n' held back on the way
    ("xé€😀ENDy", ("END",), 20),  # characters split over tokens, then a stop string
    ("aENb", ("END",), 3),  # ends at max_tokens with 'EN' held back
    ("hello", (), 5),
])
def test_a_replayed_generation_goes_on_as_the_uninterrupted_one(
    tokenizer: Any, text: str, stop: tuple[str, ...], max_tokens: int
) -> None:
    whole = gen(tokenizer, max_tokens, stop)
    want = feed(whole, ids(text))
    assert whole.finished
    for k in range(1, len(want)):
        g = gen(tokenizer, max_tokens, stop)
        g.replay(ids(text)[:k])
        assert not g.finished
        assert feed(g, ids(text)[k:]) == want[k:]  # the same texts, held back or released at the same tokens
        assert (g.token_ids, g.text, g.finish_reason) == (whole.token_ids, whole.text, whole.finish_reason)


def test_a_replay_may_end_the_generation_but_not_go_past_its_end(tokenizer: Any) -> None:
    g = gen(tokenizer, stop=("!",))
    g.replay([*ids("hi"), EOS])
    assert (g.finish_reason, g.text, g.token_ids) == ("eos", "hi", [*ids("hi"), EOS])
    g = gen(tokenizer, stop=("!",))
    g.replay(ids("hi!"))
    assert (g.finish_reason, g.text) == ("stop", "hi")
    g = gen(tokenizer, max_tokens=2)
    with pytest.raises(ValueError, match="token 2 of 3 comes after the end of the generation"):
        g.replay(ids("hi!"))
