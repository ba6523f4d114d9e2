"""Incremental detokenization with exact stop-string handling."""

from __future__ import annotations


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
        before = len(self.text)
        # text ending in an incomplete UTF-8 character: show what is complete, keep the window
        # open until the character completes (bounded, so invalid bytes cannot stall forever)
        if new.endswith("\ufffd") and not force and len(self.token_ids) - self._read < 32:
            self.text = self._stable + new.rstrip("\ufffd")
        else:
            self._stable += new
            self.text = self._stable
            self._prefix, self._read = self._read, len(self.token_ids)
        if self.stop:
            # a new stop string must end inside the text just added
            start = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
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
        if not final and not self.stopped:
            for s in self.stop:  # hold back a tail that is a proper prefix of a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if self.text.endswith(s[:n]):
                        safe = min(safe, len(self.text) - n)
                        break
        safe = max(safe, self._sent)
        out = self.text[self._sent : safe]
        self._sent = safe
        return out
