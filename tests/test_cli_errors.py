"""Every command meets bad input with one clear line on stderr and exit status 2 — never a traceback —
and before any model loads. One table, walked for every command."""

from __future__ import annotations

import pytest

from specdecode.cli import main

MISSING = "/nonexistent/model-dir"


def table(tmp):
    good = str(tmp / "model")  # a real (tiny) model dir, for cases where the bad part is elsewhere
    return [
        # generate
        (["generate", "--target", MISSING, "--prompt", "a"], MISSING),
        (["generate", "--target", "qwen-typo", "--prompt", "a"], "models list"),
        (["generate", "--target", good, "--prompt", "a", "-k", "-1"], "num-draft-tokens"),
        (["generate", "--target", good, "--prompt", ""], "--prompt is empty"),
        (["generate", "--target", good, "--prompt", "a", "--temperature", "-1"], "temperature"),
        (["generate", "--target", good, "--prompt", "a", "--dtype", "float8"], "float8"),
        (["generate", "--target", good, "--prompt", "a", "--draft", "medusa:/nonexistent/heads"], "/nonexistent/heads"),
        (["generate", "--target", good, "--prompt-ids", "1,x"], "--prompt-ids"),
        (["generate", "--target", good, "--prompt", "a", "--threads", "0"], "--threads"),
        (["generate", "--target", good, "--prompt", "a", "--backend", "llamacpp"], ".gguf"),
        (["generate", "--target", good, "--prompt", "a", "--backend", "onnx"], "--backend"),
        (
            ["generate", "--target", good, "--prompt", "a", "--draft", "ngram", "--draft", "ngram:4"],
            "--draft-policy auto",
        ),
        (["generate", "--target", good, "--prompt", "a", "--draft-policy", "auto"], "at least one --draft"),
        (
            [
                "generate",
                "--target",
                good,
                "--prompt",
                "a",
                "--draft",
                good,
                "--draft",
                good + "/",
                "--draft-policy",
                "auto",
            ],
            "names the same draft model",
        ),
        (
            [
                "generate",
                "--target",
                good,
                "--prompt",
                "a",
                "--draft",
                "ngram",
                "--draft",
                "ngram",
                "--draft-policy",
                "auto",
            ],
            "given twice",
        ),
        (
            [
                "generate",
                "--target",
                good,
                "--prompt",
                "a",
                "--draft",
                "ngram",
                "--draft-policy",
                "auto",
                "--tree-topk",
                "2",
            ],
            "chains",
        ),
        (
            [
                "generate",
                "--target",
                good,
                "--prompt",
                "a",
                "--draft",
                "ngram",
                "--draft-policy",
                "auto",
                "--catch-up-tokens",
                "0",
            ],
            "--catch-up-tokens must be >= 1",
        ),
        # bench
        (["bench", "--target", MISSING, "--out", str(tmp / "b1")], MISSING),
        (
            ["bench", "--target", good, "--draft", "ngram", "--draft-lengths", "0", "--out", str(tmp / "b2")],
            "draft lengths",
        ),
        (["bench", "--target", good, "--draft", "ngram", "--tree-shapes", "3", "--out", str(tmp / "b3")], "tree shape"),
        (["bench", "--target", good, "--prompts", str(tmp / "nope.jsonl"), "--out", str(tmp / "b4")], "nope.jsonl"),
        (["bench", "--target", good, "--sampling", "bogus", "--out", str(tmp / "b5")], "bogus"),
        (["bench", "--target", good, "--threads", "0", "--out", str(tmp / "b6")], "--threads"),
        (["bench", "--target", good, "--draft-policy", "auto", "--out", str(tmp / "b7")], "at least one --draft"),
        (["bench", "--draft", "ngram", "--out", str(tmp / "b8")], "--target is required"),
        # check
        (["check", "--target", MISSING, "--draft", "ngram"], MISSING),
        (["check", "--target", good, "--draft", "ngram", "--parts", "9"], "part"),
        (["check", "--target", good, "--draft", "ngram", "-k", "-2"], "num-draft-tokens"),
        # serve
        (["serve", "--target", MISSING], MISSING),
        (["serve", "--target", good, "--max-batch-size", "0"], "max-batch-size"),
        (["serve", "--target", good, "--backend", "llamacpp"], ".gguf"),
        # load
        (["load", "--endpoint", "http://127.0.0.1:9", "--concurrency", "0"], "concurrency"),
        (["load", "--endpoint", "http://127.0.0.1:9", "--prompts", str(tmp / "nope.jsonl")], "nope.jsonl"),
        # models
        (["models", "convert", str(tmp / "nope.gguf")], "nope.gguf"),
        (["models", "fetch", "no-such-pair"], "no-such-pair"),
        # heads
        (["heads", "extract", "--target", MISSING, "--out", str(tmp / "f")], MISSING),
        (["heads", "extract", "--target", good, "--corpus", str(tmp / "nope"), "--out", str(tmp / "f")], "nope"),
        (["heads", "extract", "--target", good, "--max-tokens", "0", "--out", str(tmp / "f")], "max-tokens"),
        (["heads", "train", "--features", str(tmp / "nofeats"), "--out", str(tmp / "h")], "nofeats"),
        (
            ["heads", "train", "--features", str(tmp / "nofeats"), "--out", str(tmp / "h"), "--num-heads", "0"],
            "num-heads",
        ),
    ]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    from tiny import make_model, make_tokenizer

    root = tmp_path_factory.mktemp("errors")
    make_model(32, seed=0, arch="llama").save_pretrained(root / "model")
    make_tokenizer(32).save_pretrained(root / "model")
    return root


def test_every_bad_invocation_is_one_line_exit_2(tmp, capsys, monkeypatch):
    import specdecode.models.loading as loading

    real = loading.load_model
    failures = []
    for argv, culprit in table(tmp):
        loaded = []

        def spy(*a, **kw):
            loaded.append(a[0])
            return real(*a, **kw)

        monkeypatch.setattr(loading, "load_model", spy)
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        err = capsys.readouterr().err
        if code != 2 or "Traceback" in err or culprit not in err:
            failures.append(f"{' '.join(argv)}: exit {code}, stderr {err.strip()[-300:]!r}")
        elif loaded and MISSING not in argv and "qwen-typo" not in argv:
            failures.append(f"{' '.join(argv)}: loaded {loaded} before refusing")
    assert not failures, "\n".join(failures)


def test_the_llamacpp_backend_without_its_install_is_one_line_with_the_fix(tmp_path, capsys, monkeypatch):
    """Whether or not llama-cpp-python is installed here: pretend it is not."""
    from gguf_util import write_tiny_qwen2_gguf
    from specdecode.models import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    for argv in (
        ["generate", "--prompt", "a"],
        ["serve"],
        ["check", "--draft", "ngram"],
        ["bench", "--out", str(tmp_path / "b")],
    ):
        code = main([*argv, "--backend", "llamacpp", "--target", str(tmp_path / "tiny.gguf")])
        err = capsys.readouterr().err
        assert code == 2 and "scripts/install-llamacpp.sh" in err and "Traceback" not in err, (argv, err)
