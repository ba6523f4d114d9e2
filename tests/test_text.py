"""Incremental detokenization equals a full decode; stop strings cut exactly; deltas add up."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdecode.text import IncrementalText

CORPUS = ["déjà vu — naïve café, 日本語のテキスト 🙂🚀 and plain ascii words " * 3, "def f(x):\n    return x ** 2  # ünïcödé"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
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
