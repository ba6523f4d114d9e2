"""Incremental detokenization with exact stop handling: stop strings and an editor's block rule."""

from __future__ import annotations

from typing import Any, Protocol

# the longest stop string accepted (characters); matching is incremental, so its cost per token does
# not grow with the text, but each stop's table is built when the request is admitted
MAX_STOP_CHARS = 1000


class Matcher(Protocol):
    """What :class:`IncrementalText` asks of a stop rule (:class:`StopMatcher`, :class:`DedentStop`); ``states`` is
    the rule's own."""

    states: Any

    def feed(self, text: str, offset: int, states: Any = None) -> tuple[int | None, Any]: ...

    def held(self, states: Any) -> int: ...


def _prefix_function(s: str) -> list[int]:
    """Knuth–Morris–Pratt: ``pi[i]`` is the length of the longest proper prefix of ``s[: i + 1]`` that
    is also its suffix."""
    pi = [0] * len(s)
    q = 0
    for i in range(1, len(s)):
        while q and s[i] != s[q]:
            q = pi[q - 1]
        if s[i] == s[q]:
            q += 1
        pi[i] = q
    return pi


class StopMatcher:
    """Stop strings matched incrementally over a text that grows at its end: per stop, a KMP
    automaton whose state is the length of the longest prefix of the stop that the text ends with.
    Feeding n characters costs O(n) per stop (amortised), whatever the text's and the stops' lengths,
    and the state also says how much of the text's tail could still become a stop (``held``)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._pi = [_prefix_function(s) for s in stops]
        self.states = [0] * len(stops)

    def feed(self, text: str, offset: int, states: list[int] | None = None) -> tuple[int | None, list[int]]:
        """Run ``text`` (whose first character is at ``offset`` in the whole text) through the automata
        from ``states`` (default: this matcher's). Returns (the start of the earliest match that ends in
        ``text``, or None; the states after it). This matcher's states are not changed."""
        states = list(self.states if states is None else states)
        first = None
        for j, (stop, pi) in enumerate(zip(self.stops, self._pi)):
            q, n = states[j], len(stop)
            for i, c in enumerate(text):
                while q and c != stop[q]:
                    q = pi[q - 1]
                if c == stop[q]:
                    q += 1
                if q == n:  # the first match of this stop: the earliest start among its matches
                    start = offset + i + 1 - n
                    first = start if first is None else min(first, start)
                    q = pi[q - 1]
                    break
            states[j] = q
        return first, states

    @staticmethod
    def held(states: list[int]) -> int:
        """Characters at the end of the text that are a proper prefix of some stop string."""
        return max(states, default=0)


TAB_WIDTH = 8  # columns a tab advances to (Python's tokenizer's tab stops)


class DedentStop:
    """An editor's block rule, matched incrementally like :class:`StopMatcher` (same ``feed`` / ``held``
    interface): the text ends at the first line *after the first* whose indentation is less than
    ``indent`` columns, cut before it and before any blank (whitespace-only) lines that precede it,
    i.e. at the newline that ends the last kept non-blank line. The first line (the rest of the
    cursor's line) is always kept. A line's indentation is decided by its first non-blank character,
    so a trailing run of blank lines and indentation is held back until that character arrives.

    The state is ``(lines, cut, blank, width, end)``: newlines seen, the newline where the text would
    be cut, whether the current line is blank so far, its indentation so far in columns, and the
    length of the text fed."""

    def __init__(self, indent: int) -> None:
        self.indent = indent
        self.states: tuple[int, int | None, bool, int, int] = (0, None, True, 0, 0)

    def feed(self, text: str, offset: int, states: tuple | None = None) -> tuple[int | None, tuple]:
        """Run ``text`` (starting at ``offset`` in the whole text) from ``states`` (default: this
        matcher's): (the cut position if the rule ends the text inside ``text``, else None; the new
        state). This matcher's state is not changed."""
        lines, cut, blank, width, _ = self.states if states is None else states
        for i, c in enumerate(text):
            if c == "\n":
                if lines == 0 or not blank:  # a line to keep ends here
                    cut = offset + i
                lines, blank, width = lines + 1, True, 0
            elif not blank or c in "\r\f\v":
                continue
            elif c == " ":
                width += 1
            elif c == "\t":
                width += TAB_WIDTH - width % TAB_WIDTH
            else:
                blank = False
                if lines and width < self.indent:
                    return cut, (lines, cut, blank, width, offset + i + 1)
        return None, (lines, cut, blank, width, offset + len(text))

    @staticmethod
    def held(states: tuple) -> int:
        """Characters at the end of the text that the rule may still cut: from the last kept line's
        newline on, while only blank lines and indentation follow it."""
        lines, cut, blank, _, end = states
        return end - cut if lines and blank else 0


class IncrementalText:
    """Text of a growing list of generated token ids, cut before the first stop string (or where the
    block rule ``stop_dedent`` ends it: :class:`DedentStop`).

    Each ``add(token)`` decodes only a short window (the previous few tokens plus the new one) and
    appends the difference, so a long generation costs O(1) per token. Tokens that end in an
    incomplete UTF-8 character wait until it completes. ``add`` returns True when the token
    completes a stop string (or decides the block rule); the text is then cut just before it and
    nothing more should be added. ``delta()`` hands out text not yet handed out, holding back a tail
    that could still become a stop string or be cut by the rule.
    """

    def __init__(
        self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True, stop_dedent: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._stable = ""  # text of token_ids[:_read], which later tokens cannot change
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] give the context the next decode is diffed against
        self._read = 0
        self._sent = 0
        # stop strings, and the block rule (``stop_dedent``: see DedentStop); their states cover _stable
        # (which only grows)
        self._stops: list[Matcher] = ([StopMatcher(stop)] if stop else []) + (
            [DedentStop(stop_dedent)] if stop_dedent is not None else []
        )
        self._held = 0  # characters at the end of ``text`` that could still become a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> bool:
        if self.stopped:
            raise RuntimeError("text already ended at a stop string")
        self.token_ids.append(token_id)
        return self._catch_up(force=False)

    def _catch_up(self, force: bool) -> bool:
        context = self._decode(self.token_ids[self._prefix : self._read])
        window = self._decode(self.token_ids[self._prefix :])
        new = window[len(context) :]
        # text ending in an incomplete UTF-8 character: show what is complete, keep the window
        # open until the character completes (bounded, so invalid bytes cannot stall forever)
        if new.endswith("\ufffd") and not force and len(self.token_ids) - self._read < 32:
            tail = new.rstrip("\ufffd")  # shown, but a later token may still change it
            stable = ""
        else:
            tail, stable = "", new
            self._prefix, self._read = self._read, len(self.token_ids)
        first, self._held = None, 0
        for matcher in self._stops:
            # only the new text is scanned: a stop string that completes must end inside it
            found, states = matcher.feed(stable, len(self._stable))
            matcher.states = states
            if found is None and tail:
                found, states = matcher.feed(tail, len(self._stable) + len(stable), states)
            self._held = max(self._held, matcher.held(states))
            if found is not None:
                first = found if first is None else min(first, found)
        self._stable += stable
        self.text = self._stable + tail
        if first is not None:
            self.text, self.stopped = self.text[:first], True
        return self.stopped

    def finish(self) -> str:
        """The whole text, flushing a trailing incomplete character as U+FFFD."""
        if not self.stopped and self._read < len(self.token_ids):
            self._catch_up(force=True)
        return self.text

    def delta(self, final: bool = False) -> str:
        if final:
            self.finish()
        safe = len(self.text)
        if not final and not self.stopped:  # hold back a tail that is a proper prefix of a stop string
            safe -= self._held
        safe = max(safe, self._sent)
        out = self.text[self._sent : safe]
        self._sent = safe
        return out
