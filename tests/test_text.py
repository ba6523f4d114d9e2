"""Incremental detokenization equals a full decode; stop strings cut exactly; deltas add up."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.server.protocol import MAX_STOP_STRINGS as MAX_STOP_PIECES
from specdecode.text import MAX_STOP_CHARS, IncrementalText, StopMatcher

CORPUS = [
    "déjà vu — naïve café, 日本語のテキスト 🙂🚀 and plain ascii words " * 3,
    "def f(x):\n    return x ** 2  # ünïcödé",
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def feed(tokenizer, ids, stop=()):
    text = IncrementalText(tokenizer, stop)
    pieces = []
    for i in ids:
        stopped = text.add(i)
        pieces.append(text.delta())
        if stopped:
            break
    pieces.append(text.delta(final=True))
    return text, "".join(pieces)


def test_incremental_text_equals_full_decode(tokenizer):
    rng = random.Random(0)
    pool = "".join(sorted(set("".join(CORPUS))))
    for _ in range(200):  # valid text, tokenized: multi-byte characters split across tokens
        s = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 30)))
        ids = tokenizer(s).input_ids + [tokenizer.eos_token_id]
        text, streamed = feed(tokenizer, ids)
        assert streamed == text.finish() == s
    for _ in range(200):  # random ids may be invalid UTF-8: nothing may be lost or invented
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        _, streamed = feed(tokenizer, ids)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert streamed.replace("\ufffd", "") == full.replace("\ufffd", "")
    for s in CORPUS:
        ids = tokenizer(s).input_ids
        text, streamed = feed(tokenizer, ids)
        assert text.text == streamed == s


def test_stop_string_cuts_exactly_and_is_never_streamed(tokenizer):
    s = CORPUS[0]
    ids = tokenizer(s).input_ids
    for stop in ("café", "🚀", "テキ", "words déjà"):
        text, streamed = feed(tokenizer, ids, (stop,))
        assert text.stopped and text.text == s[: s.index(stop)] and streamed == text.text
        consumed = tokenizer.decode(text.token_ids)
        assert stop in consumed and stop not in tokenizer.decode(text.token_ids[:-1])  # cut at the completing token


def test_delta_holds_back_possible_stop_prefix(tokenizer):
    text = IncrementalText(tokenizer, ("XYZ",))
    for i in tokenizer("abcXY").input_ids:
        text.add(i)
    assert text.delta() == "abc"  # "XY" might still become "XYZ"
    assert text.delta(final=True) == "XY"


def _reference(text: str, stops: tuple[str, ...]) -> tuple[int | None, int]:
    """Brute force: (the start of the earliest stop string in ``text``, the longest proper prefix of a
    stop that ``text`` ends with)."""
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return (min(hits) if hits else None), held


def test_stop_matcher_equals_brute_force_on_random_texts():
    """Fed in random pieces, the automata find the same earliest stop and hold back the same tail as a
    scan of the whole text (periodic stops like 'abab' exercise the failure links)."""
    rng = random.Random(1)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4)))
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 25)))
        matcher, fed, found = StopMatcher(stops), 0, None
        while fed < len(text) and found is None:
            piece = text[fed : fed + rng.randrange(1, 5)]
            found, matcher.states = matcher.feed(piece, fed)
            fed += len(piece)
        first, held = _reference(text[:fed], stops)
        assert found == first, (stops, text)
        if found is None:
            assert StopMatcher.held(matcher.states) == held, (stops, text)


class _CountingStr(str):
    reads = 0

    def __getitem__(self, i):
        _CountingStr.reads += 1
        return str.__getitem__(self, i)


def test_stop_matching_cost_does_not_grow_with_the_text_or_the_stop_length(tokenizer):
    """16 stops of MAX_STOP_CHARS characters over a long text streamed token by token — half a long
    run of the text's own pattern (a long tail is always held back), half sharing nothing with it: the
    stops' characters read per character of text stay bounded (KMP: amortised <= 2 per stop and
    character), where scanning for the held-back tail at every step read O(stop length ** 2) for a
    stop that does not occur. Counted reads, not time."""
    unit = "naïve café "
    half = MAX_STOP_PIECES // 2
    stops = tuple(
        _CountingStr((unit * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 2] + "X" + str(i)) for i in range(half)
    ) + tuple(_CountingStr("Z" * (MAX_STOP_CHARS - 1) + str(i)) for i in range(half))
    text_in = unit * 150
    ids = tokenizer(text_in).input_ids
    text = IncrementalText(tokenizer, stops)
    _CountingStr.reads = 0
    streamed = []
    for i in ids:
        assert not text.add(i)
        streamed.append(text.delta())
    assert _CountingStr.reads <= 2 * 2 * len(text_in) * len(stops)  # (the comparison and the advance)
    held = len(text_in) - len("".join(streamed))
    assert held >= MAX_STOP_CHARS - 2 - len(unit)  # a long tail is held back: it could still become a stop
    assert "".join(streamed) + text.delta(final=True) == text_in


def test_a_long_stop_across_tokens_and_an_unfinished_character(tokenizer):
    s = CORPUS[0]
    stop = s[10 : 10 + 60]  # spans many tokens and multi-byte characters
    text, streamed = feed(tokenizer, tokenizer(s).input_ids, (stop, "never-there"))
    assert text.stopped and text.text == streamed == s[:10]
