"""Tokenizer wrapper and the incremental detokenizer: partial UTF-8, stop strings, exact text."""

from __future__ import annotations

import random

import pytest

from phloem.sessions import InvalidInput, Tokenizer


def feed(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str, int]:
    """Push ``ids`` one by one until a stop string; return the deltas, the text and how many
    tokens were consumed."""
    detok = tokenizer.detokenizer(stop)
    deltas = []
    consumed = 0
    for token in ids:
        deltas.append(detok.push(token))
        consumed += 1
        if detok.stopped:
            break
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return deltas, detok.text, consumed


def test_encode_recognises_special_tokens_and_adds_none(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi")
    assert ids[0] == tokenizer.encode("<|im_start|>")[0]
    assert len(tokenizer.encode("<|im_start|>")) == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi"
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.eos_token_ids and set(tokenizer.eos_token_ids) <= tokenizer.special_token_ids


def test_partial_utf8_is_held_back_until_complete(tokenizer: Tokenizer) -> None:
    text = "naïve 日本語 ✓ 🦜!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()), "multi-byte characters should span several byte tokens"
    deltas, out, _ = feed(tokenizer, ids)
    assert out == text
    assert all("\ufffd" not in d for d in deltas)
    # Somewhere a token completed no character: its delta was empty, not a replacement char.
    assert "" in deltas[:-1]


def test_incomplete_utf8_tail_is_flushed_at_finish(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 日")
    cut = ids[:-1]  # the last byte of 日 is missing
    deltas, out, _ = feed(tokenizer, cut)
    assert out == tokenizer.decode(cut)
    assert out.startswith("ok ") and out.endswith("\ufffd")
    assert "\ufffd" in deltas[-1], "the broken tail only appears in finish()"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(3, 1914) for _ in range(200)]
    _, out, _ = feed(tokenizer, ids)
    assert out == tokenizer.decode(ids)


def test_unknown_ids_add_no_text_and_keep_the_window_small(tokenizer: Tokenizer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A model may sample ids past its tokenizer's (the dummy-weight shapes do, 99% of the time):
    they decode to nothing, so the text and deltas are those of the known ids alone, and each push
    decodes a window of a few ids, not every id since the last printable one."""
    rng = random.Random(3)
    known = tokenizer.encode("naïve 日本語, then plain words")
    ids = [i for k in known for i in (k, *(tokenizer.id_limit + rng.randrange(10_000) for _ in range(40)))]
    want_deltas, want, _ = feed(tokenizer, known)
    longest = 0
    decode = tokenizer.decode

    def counting_decode(token_ids: list[int], skip_special_tokens: bool = True) -> str:
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    deltas, out, _ = feed(tokenizer, ids)
    assert out == want == decode(ids)
    assert [d for d in deltas if d] == [d for d in want_deltas if d]
    assert longest <= 8, longest


def test_stop_string_cuts_text_and_keeps_the_completing_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42.</answer> and more text")
    deltas, out, consumed = feed(tokenizer, ids, stop=("</answer>",))
    assert out == "The answer is 42."
    # The token that completed the stop string was consumed; nothing after it.
    assert "</answer>" in tokenizer.decode(ids[:consumed])
    assert "</answer>" not in tokenizer.decode(ids[:consumed - 1])
    assert not any("<" in d for d in deltas), "a possible stop-string prefix is never emitted"


def test_stop_string_prefix_is_released_when_it_does_not_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a </ans b")
    deltas, out, consumed = feed(tokenizer, ids, stop=("</answer>",))
    assert out == "a </ans b" and consumed == len(ids)


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four")
    _, out, _ = feed(tokenizer, ids, stop=("four", "two"))
    assert out == "one "


def test_stop_at_the_very_start(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("STOP now")
    deltas, out, consumed = feed(tokenizer, ids, stop=("STOP",))
    assert out == "" and all(d == "" for d in deltas)


def test_special_tokens_are_skipped_and_cannot_match_stop(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hi<|im_end|>")
    _, out, consumed = feed(tokenizer, ids, stop=("<|im_end|>",))
    assert out == "hi" and consumed == len(ids)


def test_empty_stop_string_is_invalid(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidInput, match="non-empty"):
        tokenizer.detokenizer(("",))
