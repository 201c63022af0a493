"""Tokens to text as they stream: incremental detokenization and stop strings.

Used by ``eaglespec generate`` (streamed to the terminal) and by the server (streamed to a client).
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase


# what transformers' `clean_up_tokenization` rewrites (a tokenizer with clean_up_tokenization_spaces
# on): the next token can change the end of the text decoded so far
CLEAN_UP = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")


class TextStream:
    """The text of a growing list of tokens, released only once it is final: the pieces released
    join to the decoding of all the tokens.

    Held back: a trailing half of a multi-byte character (the tokenizer decodes it as U+FFFD until
    the next token completes it), any tail that could still become a stop string, and, where the
    tokenizer cleans up spaces, any tail that the next token could make it rewrite. When a stop
    string appears, the text ends just before it and `stopped` is set.
    """

    def __init__(self, tok: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tok = tok
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False
        self.used = 0  # tokens the text needed: all pushed, or those up to the end of the stop string

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the text that became final (possibly "")."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids += ids
        self.used = len(self.ids)
        full = self.tok.decode(self.ids, skip_special_tokens=True)
        cut = self._first_stop(full)
        if cut is not None:
            self.stopped = True
            # a round may accept tokens past the stop string: they were never the answer's, and
            # vanilla decoding would have stopped at the first prefix that holds the stop string
            self.used = next(n for n in range(before + 1, len(self.ids) + 1)
                             if self._first_stop(self.tok.decode(self.ids[:n], skip_special_tokens=True)) is not None)
            return self._release(full[:cut])
        end = len(full.rstrip("\ufffd"))
        hold = 0  # the longest tail that is the start of a stop string, or of a clean-up rewrite
        pending = self.stop + (list(CLEAN_UP) if getattr(self.tok, "clean_up_tokenization_spaces", False) else [])
        for s in pending:
            hold = max(hold, next((k for k in range(min(len(s) - 1, end), 0, -1) if full[:end].endswith(s[:k])), 0))
        return self._release(full[:max(end - hold, len(self.text))])

    def finish(self) -> str:
        """The rest of the text once decoding ended (what was held back, if no stop string came)."""
        if self.stopped:
            return ""
        return self._release(self.tok.decode(self.ids, skip_special_tokens=True))

    def _first_stop(self, full: str) -> int | None:
        # a stop string can only newly appear overlapping text not yet released
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _release(self, upto: str) -> str:
        new = upto[len(self.text):]
        self.text = upto
        return new
