"""Incremental detokenisation with stop strings.

Text that could still turn out to be the start of a stop string is held back, so the stream never
carries a partial stop string; once a stop string appears, the text before it is released and no more.
Which stop string ends the text does not depend on how the text was split into tokens: it is the one
that is complete first when the text is read character by character.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.stop = tuple(s for s in stop if s)
        self.text = ""
        self.num_emitted = 0  # characters of `text` already released
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Adds one token; returns the text that may be released now. Sets `stopped` on a stop string."""
        self.text += self.stream.step(self.tokenizer, token_id) or ""
        pending = self.text[self.num_emitted :]
        # the stop string that is complete first, character by character, wins (ties: the longer one)
        hits = [(i + len(s), i) for s, i in ((s, pending.find(s)) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits)[1])
        return self._release(len(pending) - self._held_back(pending))

    def flush(self) -> str:
        """Releases what was held back, when the request ends for another reason than a stop string."""
        return "" if self.stopped else self._release(len(self.text) - self.num_emitted)

    def _held_back(self, pending: str) -> int:
        # longest suffix of `pending` that is a proper prefix of some stop string
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), longest, -1):
                if pending.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, num_chars: int) -> str:
        out = self.text[self.num_emitted : self.num_emitted + num_chars]
        self.num_emitted += num_chars
        return out
