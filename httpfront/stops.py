"""Stop strings, matched on the generated text as it streams.

OpenAI's `stop` ends a completion as soon as one of the strings appears in it (the first to be
completed, as the text grows); the text returned stops just before that string. Tokens arrive as
pieces of text, and a stop string may straddle pieces, so text that could be the start of a stop
string is held back until the next piece says whether it is one:

    stops = StopText(("###", "\\n\\n"))
    stops.feed("Hello #")   # -> "Hello "  ("#" may begin "###")
    stops.feed("## more")   # -> ""        (matched: stops.stopped, stops.text == "Hello ")
    stops.flush()           # at the end without a match: what was held back

Invariant: no match starts before the released text's end, so a search only ever looks at what was
held back plus the new piece.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Generated text passed through stop strings: what may be released now, and where a stop matched."""

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not isinstance(stop, str) or not stop for stop in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self._stops = tuple(stops)
        self._longest = max((len(stop) for stop in self._stops), default=0)
        self._text = ""  # everything fed so far, up to the match once stopped
        self._released = 0  # characters of _text handed out
        self.stopped = False  # a stop string matched; nothing more is released
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """The text so far, cut before the stop string once one matched (released or held back)."""
        return self._text

    @property
    def released(self) -> str:
        return self._text[: self._released]

    def feed(self, piece: str) -> str:
        """Add a piece of generated text; the text that may be shown now (possibly "")."""
        if self.stopped:
            return ""
        self._text += piece
        if not self._stops:
            return self._release(len(self._text))
        # The stop completed first wins (as if the text came one character at a time, so how it was
        # cut into pieces cannot change the answer); of two ending together, the one starting first.
        found = [(index, stop) for stop in self._stops if (index := self._text.find(stop, self._released)) >= 0]
        if found:
            index, stop = min(found, key=lambda item: (item[0] + len(item[1]), item[0]))
            self.stopped, self.matched = True, stop
            self._text = self._text[:index]
            return self._release(index)
        return self._release(self._hold_from())

    def flush(self) -> str:
        """The generation ended without (further) matches: release what was held back."""
        if self.stopped:
            return ""
        return self._release(len(self._text))

    def _hold_from(self) -> int:
        """Where the longest suffix that is a proper start of some stop string begins (len: none)."""
        end = len(self._text)
        for start in range(max(self._released, end - self._longest + 1), end):
            tail = self._text[start:]
            if any(stop.startswith(tail) for stop in self._stops):
                return start
        return end

    def _release(self, upto: int) -> str:
        out = self._text[self._released : upto]
        self._released = upto
        return out


__all__ = ["StopText"]
