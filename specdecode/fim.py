"""Fill-in-the-middle (FIM): the model's own FIM tokens, the prompt an editor's request becomes, and
when a completion ends.

**Tokens.** Read from the tokenizer, never configured per model: the first of the known spellings
(:data:`CONVENTIONS`) whose three markers are each one token of the vocabulary. A tokenizer without
them raises :class:`FimUnsupported` naming what was looked for (the server answers 400).

**Prompt** (prefix-suffix-middle order): the tokenizer's own leading special tokens (BOS where it puts
one before any text: CodeLlama, DeepSeek-Coder; nothing for Qwen or StarCoder), the prefix marker, the
prefix text, the suffix marker, the suffix text, the middle marker. Prefix and suffix are tokenized
without special tokens. The model then writes the middle.

**End.** A completion ends at any of the model's end tokens (:attr:`FimTokens.end`: the convention's
end and pad tokens, its markers, the tokenizer's EOS), like EOS: the token is not in the text and the
finish reason is ``stop``. An editor may also cut it shorter (``fim_stop``, :data:`FIM_STOPS`):

* ``none``: the end tokens only;
* ``line``: at the first newline (a single-line completion: the rest of the cursor's line);
* ``block``: at the first line, after the first generated line, indented less than the line the
  cursor is on, or at the blank lines before such a line (a multi-line block completion: the
  body of the block the cursor is in). Tabs advance to multiples of 8 columns. A cursor line at
  column 0 never ends a block this way. The default (:data:`DEFAULT_FIM_STOP`): what an editor expects
  of a completion at its cursor, where a model left alone often writes on past the hole.

**Exactness.** FIM changes only the prompt and adds stops. Verification is untouched, so the tokens
follow the target's law given that prompt; a stop only cuts the output where the rule says (as a stop
string does), after the token that decides it, and never changes what was sampled before.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import UserError
from specdecode.text import TAB_WIDTH

FIM_STOPS = ("none", "line", "block")
DEFAULT_FIM_STOP = "block"  # a request with a suffix that names no rule: the rest of the cursor's block


class FimUnsupported(UserError, ValueError):
    """The model's tokenizer has no fill-in-the-middle tokens."""


@dataclass(frozen=True)
class Convention:
    """One spelling of the FIM tokens: each marker's accepted spellings, and the tokens that end a
    completion (looked up when present)."""

    name: str
    prefix: tuple[str, ...]
    suffix: tuple[str, ...]
    middle: tuple[str, ...]
    end: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.prefix[0]} {self.suffix[0]} {self.middle[0]} ({self.name})"


CONVENTIONS = (
    Convention(
        "Qwen2.5-Coder, CodeGemma",
        ("<|fim_prefix|>",),
        ("<|fim_suffix|>",),
        ("<|fim_middle|>",),
        ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>"),
    ),
    Convention(
        "StarCoder, StarCoder2, SantaCoder",
        ("<fim_prefix>", "<fim-prefix>"),
        ("<fim_suffix>", "<fim-suffix>"),
        ("<fim_middle>", "<fim-middle>"),
        ("<|endoftext|>", "<fim_pad>", "<fim-pad>", "<file_sep>", "<repo_name>"),
    ),
    # CodeLlama's sentencepiece vocabulary spells them with the word-start mark: "▁<PRE>"
    Convention("CodeLlama", ("<PRE>", "▁<PRE>"), ("<SUF>", "▁<SUF>"), ("<MID>", "▁<MID>"), ("<EOT>", "▁<EOT>")),
    Convention(
        "DeepSeek-Coder",
        ("<｜fim▁begin｜>",),
        ("<｜fim▁hole｜>",),
        ("<｜fim▁end｜>",),
        ("<|EOT|>", "<｜end▁of▁sentence｜>"),
    ),
)


@dataclass(frozen=True)
class FimTokens:
    convention: str
    prefix: int
    suffix: int
    middle: int
    end: tuple[int, ...]  # ids that end a completion, sorted
    lead: tuple[int, ...]  # the tokenizer's own special tokens before any text (BOS or nothing)


def fim_tokens(tokenizer) -> FimTokens:
    """The model's FIM tokens, read from its tokenizer; :class:`FimUnsupported` if it has none."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab = get_vocab() if callable(get_vocab) else {}

    def first(spellings: tuple[str, ...]) -> int | None:
        return next((vocab[s] for s in spellings if isinstance(vocab.get(s), int)), None)

    for conv in CONVENTIONS:
        prefix, suffix, middle = first(conv.prefix), first(conv.suffix), first(conv.middle)
        if prefix is None or suffix is None or middle is None:
            continue
        end: set[int] = {vocab[s] for s in conv.end if isinstance(vocab.get(s), int)} | {prefix, suffix, middle}
        eos = getattr(tokenizer, "eos_token_id", None)
        end |= {eos} if isinstance(eos, int) else set(eos or ())
        lead = [t for t in tokenizer("", add_special_tokens=True).input_ids if t != eos]
        return FimTokens(conv.name, prefix, suffix, middle, tuple(sorted(end)), tuple(lead))
    looked = "; ".join(conv.describe() for conv in CONVENTIONS)
    raise FimUnsupported(
        f"this model has no fill-in-the-middle tokens (looked for {looked}): "
        "use a FIM-trained code model, or send no suffix"
    )


def fim_prompt(tokenizer, prefix: str, suffix: str, tokens: FimTokens | None = None) -> list[int]:
    """The prompt ids in prefix-suffix-middle order (see the module docstring)."""
    tokens = tokens or fim_tokens(tokenizer)

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []

    return [*tokens.lead, tokens.prefix, *encode(prefix), tokens.suffix, *encode(suffix), tokens.middle]


def indent_width(line: str) -> int:
    """Columns of a line's leading blanks (tabs advance to multiples of :data:`~specdecode.text.TAB_WIDTH`)."""
    width = 0
    for c in line:
        if c == " ":
            width += 1
        elif c == "\t":
            width += TAB_WIDTH - width % TAB_WIDTH
        elif c not in "\r\f\v":
            break
    return width


def cursor_indent(prefix: str) -> int:
    """The indentation of the line the cursor is on: the prefix's last line."""
    return indent_width(prefix.rpartition("\n")[2])


def stop_fields(tokens: FimTokens, rule: str, prefix: str) -> dict:
    """:class:`~specdecode.sampling.SamplingParams` fields for a FIM request: its end tokens, and the
    editor rule ``rule`` (one of :data:`FIM_STOPS`) as a stop string (``line``: ``"\\n"``, added to
    the request's own) or the block rule (``stop_dedent``)."""
    if rule not in FIM_STOPS:
        raise ValueError(f"fim_stop must be one of {', '.join(FIM_STOPS)}, got {rule!r}")
    return {
        "stop_token_ids": tokens.end,
        "stop": ("\n",) if rule == "line" else (),
        "stop_dedent": cursor_indent(prefix) if rule == "block" else None,
    }
