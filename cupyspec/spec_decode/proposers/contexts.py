"""Each running sequence's tokens as an int32 array for the proposers, kept from step to step."""

from __future__ import annotations

import numpy as np

from cupyspec.scheduling.sequence import Sequence


class Contexts:
    """seq_id -> a growing int32 buffer of the sequence's prompt + output.

    A call copies only the tokens added since the last one (and the last one again: while a step is
    in flight, a sequence's last token is a placeholder that is replaced later), so drafting does not
    convert a sequence's whole token list at every step.
    """

    def __init__(self) -> None:
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> ([capacity] int32, tokens held)

    def of(self, seq: Sequence, stop: int | None = None) -> np.ndarray:
        """[stop] int32, read-only: seq's tokens [0, stop) (default: all of them)."""
        stop = seq.num_tokens if stop is None else stop
        buffer, held = self._buffers.get(seq.seq_id, (None, 0))
        if buffer is None or buffer.size < stop:
            grown = np.empty(max(2 * stop, 64), dtype=np.int32)
            if buffer is not None:
                grown[:held] = buffer[:held]
            buffer = grown
        start = max(0, min(held, stop) - 1)
        buffer[start:stop] = seq.tokens(start, stop)
        self._buffers[seq.seq_id] = (buffer, stop)
        view = buffer[:stop]
        view.flags.writeable = False
        return view

    def forget(self, seq_id: int) -> None:
        self._buffers.pop(seq_id, None)
