"""Stop strings over a stream of text deltas.

    fed so far:  | emitted ............ | held back |
                                        ^ earliest j where fed[j:] is a proper
                                          prefix of some stop string

Text is held back only while it could still become (the start of) a stop
string. A match ends the stream: the text before it is emitted, the stop
string itself never is. Among matches the earliest start wins, and at the
same start the shortest (it completes first), so the outcome does not
depend on how the text was split into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """Feed text deltas; get back what is safe to emit and whether a stop matched."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stop_strings))  # dedupe, keep order
        self._held = ""
        self.matched: str | None = None

    @property
    def held_back(self) -> str:
        """Text fed but not yet emitted (a possible stop-string prefix)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text to emit now, the stop string that matched or None).

        After a match the checker is finished; feeding more raises ValueError.
        """
        if self.matched is not None:
            raise ValueError("stop string already matched; the stream is finished")
        if not self.stops:
            return delta, None
        buf = self._held + delta
        match = self._earliest_match(buf)
        pending = self._pending_start(buf)
        if match is not None and (pending is None or pending >= match[0]):
            start, stop = match
            self.matched, self._held = stop, ""
            return buf[:start], stop
        cut = len(buf) if pending is None else pending
        self._held = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        """The stream ended for another reason: release the held-back text."""
        out, self._held = self._held, ""
        return out

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or (i, len(stop)) < best[:2]):
                best = (i, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _pending_start(self, buf: str) -> int | None:
        """Earliest j with buf[j:] a proper prefix of some stop string."""
        longest = max(len(s) for s in self.stops)
        for j in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[j:]
            if any(len(tail) < len(s) and s.startswith(tail) for s in self.stops):
                return j
        return None
