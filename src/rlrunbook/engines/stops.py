"""When a row stops: token-id stop sequences and stop strings, checked after every token.

Token-id stops compare each row's generated tokens with every stop sequence. Stop strings are the
one place an engine decodes: only a tail window of each unfinished row's generated tokens (never
the prompt) is decoded, and the row ends at the token whose text completes the string. A match
that completes at the newest token spans at most ``len(string)`` characters, a character is at most
4 bytes and every token carries at least one byte, so ``4 * len(string)`` tokens (plus a margin)
always hold it. Nothing decoded is re-encoded.
"""

from __future__ import annotations

from collections.abc import Callable

DecodeBatch = Callable[[list[list[int]]], list[str]]  # token-id rows -> their text


class StopTracker:
    """Generated tokens per row and where each row ended (``None`` while it runs)."""

    def __init__(self, rows: int, stops: tuple[tuple[int, ...], ...], strings: tuple[str, ...] = (),
                 decode_batch: DecodeBatch | None = None):
        self.generated: list[list[int]] = [[] for _ in range(rows)]
        self.ends: list[int | None] = [None] * rows
        self._stops = stops
        self._strings = strings
        self._decode_batch = decode_batch
        self._window = 4 * max((len(s) for s in strings), default=0) + 8

    def running(self) -> list[int]:
        return [row for row, end in enumerate(self.ends) if end is None]

    def append(self, rows: list[int], tokens: list[int]) -> None:
        """Record one new token for each of ``rows`` and mark the rows that stopped with it."""
        for row, token in zip(rows, tokens, strict=True):
            self.generated[row].append(token)
            if self._stops and any(tuple(self.generated[row][-len(s):]) == s for s in self._stops):
                self.ends[row] = len(self.generated[row])
        if self._strings:
            pending = [row for row in rows if self.ends[row] is None]
            texts = self._decode_batch([self.generated[row][-self._window:] for row in pending]) if pending else []
            for row, text in zip(pending, texts, strict=True):
                if any(s in text for s in self._strings):
                    self.ends[row] = len(self.generated[row])

    def kept(self, row: int) -> int:
        """How many of the row's generated tokens are returned (all of them unless a stop ended it)."""
        end = self.ends[row]
        return len(self.generated[row]) if end is None else end
