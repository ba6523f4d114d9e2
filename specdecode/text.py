"""Incremental detokenization with exact stop-string handling."""

from __future__ import annotations


class IncrementalText:
    """Text of a growing list of generated token ids, cut before the first stop string.

    ``add(token)`` returns True when the token completes a stop string; the text is then cut just
    before it and no further tokens should be added. ``delta()`` returns text not yet handed out,
    holding back an incomplete UTF-8 character and any tail that could still become a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._sent = 0

    def add(self, token_id: int) -> bool:
        self.token_ids.append(token_id)
        if not self.stop:
            return False
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        # a stop string can only be new if it ends inside the text added since the last token
        window_start = max(0, len(self.text) - max(len(s) for s in self.stop))
        hits = [i for s in self.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            self.text, self.stopped = text[: min(hits)], True
        else:
            self.text = text
        return self.stopped

    def finish(self) -> str:
        """Full text once generation ended (decodes once when there were no stop strings)."""
        if not self.stop:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.text

    def delta(self, final: bool = False) -> str:
        if not self.stop:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        safe = len(self.text)
        if not final:
            while safe and self.text[safe - 1] == "\ufffd":
                safe -= 1
            for s in self.stop:  # hold back a tail that is a proper prefix of a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if self.text[safe - n : safe] == s[:n]:
                        safe -= n
                        break
        safe = max(safe, self._sent)
        out = self.text[self._sent : safe]
        self._sent = safe
        return out
