"""Incremental detokenization with exact stop-string handling."""

from __future__ import annotations

# the longest stop string accepted (characters); matching is incremental, so its cost per token does
# not grow with the text, but each stop's table is built when the request is admitted
MAX_STOP_CHARS = 1000


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


class IncrementalText:
    """Text of a growing list of generated token ids, cut before the first stop string.

    Each ``add(token)`` decodes only a short window (the previous few tokens plus the new one) and
    appends the difference, so a long generation costs O(1) per token. Tokens that end in an
    incomplete UTF-8 character wait until it completes. ``add`` returns True when the token
    completes a stop string; the text is then cut just before it and nothing more should be added.
    ``delta()`` hands out text not yet handed out, holding back a tail that could still become a
    stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
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
        self._stops = StopMatcher(stop) if stop else None  # its states cover _stable (which only grows)
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
        if self._stops is not None:
            # only the new text is scanned: a stop string that completes must end inside it
            first, states = self._stops.feed(stable, len(self._stable))
            self._stops.states = states
            if first is None and tail:
                first, states = self._stops.feed(tail, len(self._stable) + len(stable), states)
            self._held = StopMatcher.held(states)
        self._stable += stable
        self.text = self._stable + tail
        if self._stops is not None and first is not None:
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
