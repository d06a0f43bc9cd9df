"""Logprobs rendered as OpenAI chat `logprobs.content` JSON, on the device: the CUDA kernel and its twin.

A chat stream with `top_logprobs=5` carries six JSON objects per token. Built on the host (a
record per token, then response objects, then the encoder) they cost host time per token, which a
host-bound step at many streams pays out of its throughput. Here a kernel writes the entries right
after the logprobs are gathered (a verified step's into the gather's buffer), from a table of each
token's `"token"` string and `"bytes"` list, JSON-encoded once; they reach the host with the
logprobs and are sliced per request (`LogprobsJSON`), ready to send.

An entry, with the request's first k alternatives:

    {"token":T,"logprob":X,"bytes":B,"top_logprobs":[{"token":T1,"logprob":X1,"bytes":B1},...]}

A logprob X is written with 9 significant digits (enough to give back the float32 exactly),
trailing zeros dropped, in positional notation from 1e-4 up and as `2.5e-07` below, as Python
writes floats; at or below MIN_LOGPROB, -inf and NaN as MIN_LOGPROB (JSON has no -inf).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from cupyspec.kernels import load_kernel
from cupyspec.text.token_text import TokenText
from cupyspec.transfer import to_device

if TYPE_CHECKING:
    from cupyspec.outputs import TokenLogprob

MIN_LOGPROB = -9999.0  # a token the model rules out gets this floor, as vLLM reports it
NUMBER_BYTES = 16  # the longest formatted logprob: -0.000123456789 or -1.23456789e-05
ENTRY_KEY_BYTES = 52  # the longest fixed part of an entry: {"token":,"logprob":,"bytes":,"top_logprobs":[]},
SIGNIFICANT_DIGITS = 9
THREADS = 1024  # a block, as in cuda/logprob_json.cu
SLOTS_PER_BLOCK = 64  # entry slots (a token each) one block writes: blocks on many SMs share the writing


@dataclass(frozen=True)
class VocabJSON:
    """Token t's `"token"` string, then its `"bytes"` list, JSON-encoded: text at
    blob[at[2t]:at[2t+1]], bytes list at blob[at[2t+1]:at[2t+2]]."""

    blob: np.ndarray  # [S] uint8
    at: np.ndarray  # [2V+1] int64
    max_token_bytes: int  # the longest text and bytes list of one token, together
    mean_token_bytes: float

    @classmethod
    def build(cls, texts: TokenText, vocab_size: int) -> VocabJSON:
        parts = []
        for token_id in range(vocab_size):
            text, raw = texts.entry(token_id)
            parts += (msgspec.json.encode(text), msgspec.json.encode(raw))
        sizes = np.array([len(p) for p in parts], dtype=np.int64)  # [2V]
        per_token = sizes[0::2] + sizes[1::2]  # [V]
        return cls(np.frombuffer(b"".join(parts), dtype=np.uint8), np.concatenate([[0], np.cumsum(sizes)]),
                   int(per_token.max()), float(per_token.mean()))

    def capacity(self, num_rows: int, k: int) -> int:
        """Bytes (a multiple of 8) for the entries of num_rows rows with k alternatives each on a GPU:
        those of one row of the longest tokens, or of num_rows rows of tokens twice the mean length,
        whichever is more. Entries that outgrow it are rendered again on the host (`LogprobRenderer.entries`)."""
        entry = ENTRY_KEY_BYTES + NUMBER_BYTES
        need = (k + 1) * max(entry + self.max_token_bytes, num_rows * (entry + math.ceil(2 * self.mean_token_bytes)))
        return -(-need // 8) * 8

    def token_json(self, token_id: int) -> tuple[bytes, bytes]:
        at = self.at
        return (self.blob[at[2 * token_id]:at[2 * token_id + 1]].tobytes(),
                self.blob[at[2 * token_id + 1]:at[2 * token_id + 2]].tobytes())


@dataclass(slots=True, eq=False)
class LogprobsJSON:
    """Chat `logprobs.content` entries of consecutive tokens, each followed by a comma. One is made
    per request and step, so it is cheap to make: not frozen (a frozen dataclass's __init__ sets
    each field through object.__setattr__, which is slower), and its entries' ends kept as the
    render counted them, from `start`."""

    data: bytes | memoryview  # a view of the bytes of a step's entries: slicing bytes per request would copy them
    ends: Sequence[int]  # token i's entry (with its comma) ends at data[ends[i] - start]
    start: int = 0

    def __len__(self) -> int:
        return len(self.ends)

    def __eq__(self, other: object) -> bool:  # the same entries, wherever their ends were counted from
        return isinstance(other, LogprobsJSON) and self.data == other.data and \
            [e - self.start for e in self.ends] == [e - other.start for e in other.ends]

    def head(self, n: int) -> LogprobsJSON:
        """The first n tokens' entries."""
        if n >= len(self.ends):
            return self
        return LogprobsJSON(self.data[:self.ends[n - 1] - self.start] if n else b"", self.ends[:n], self.start)

    @classmethod
    def concat(cls, parts: list[LogprobsJSON]) -> LogprobsJSON:
        ends, offset = [], 0
        for part in parts:
            ends += [offset - part.start + e for e in part.ends]
            offset += len(part.data)
        return cls(b"".join(p.data for p in parts), ends)

    def json(self) -> bytes:
        """The entries as a JSON list."""
        return b"[" + self.data[:-1] + b"]"


# ---------------------------------------------------------------- rendering

class LogprobRenderer:
    """Renders rows of logprobs into entries (`render`), with the vocabulary table on xp's device,
    and cuts the host copies into each request's entries (`entries`)."""

    def __init__(self, xp: Any, vocab: VocabJSON) -> None:
        self.vocab = vocab
        self.table = None if xp is np else (to_device(xp, vocab.blob), to_device(xp, vocab.at))  # on the device

    def render(self, xp: Any, token_ids: Any, logprobs: Any, top_ids: Any, top_lps: Any, width: int, request_k: Any,
               num_requests: int, num_rows: int, cu: Any | None = None) -> Any:
        """Entries of rows [N] (token_ids int64, logprobs f32, top_ids [N, width] int64, top_lps
        [N, width] f32) -> [N + bytes / 8] int64: where each row's entry (comma included) ends, then
        the entries' bytes. Row r belongs to request b with cu[b] <= r < cu[b+1] (cu [B+1] int64;
        None: row r is request r) and takes its first request_k[b] alternatives (< 0: the request
        wants none: its rows stay empty). Rows from cu[B] on are left out. NumPy: every entry's
        bytes; on a GPU `vocab.capacity` of them, those past it dropped (the ends count them)."""
        if xp is np:
            ends, data = _render_numpy(self.vocab, token_ids, logprobs, top_ids, top_lps, request_k, num_rows, cu)
            return np.concatenate([ends, np.frombuffer(data.ljust(-(-len(data) // 8) * 8, b"\0"), dtype=np.int64)])
        rendered = xp.empty(self.rendered_size(num_rows, width), dtype=xp.int64)
        self.render_into(rendered.data.ptr, token_ids, logprobs, top_ids, top_lps, width, request_k, num_requests,
                         num_rows, cu)
        return rendered

    def render_records(self, records: Sequence[TokenLogprob]) -> LogprobsJSON:
        """The entries of tokens whose logprobs came as records (each with the same number of
        alternatives), rendered on the host as `render` renders rows."""
        n, k = len(records), len(records[0].top_ids) if records else 0
        args = (np.array([r.token_id for r in records], np.int64), np.array([r.logprob for r in records], np.float32),
                np.array([r.top_ids for r in records], np.int64).reshape(n, k),
                np.array([r.top_logprobs for r in records], np.float32).reshape(n, k), k, np.full(n, k), n, n)
        return self.entries(self.render(np, *args), n, [(0, n)], lambda: args)[0]

    def rendered_size(self, num_rows: int, width: int) -> int:
        """int64 elements of `render`'s output on a GPU."""
        return num_rows + self.vocab.capacity(num_rows, width) // 8

    def render_into(self, address: int, token_ids: Any, logprobs: Any, top_ids: Any, top_lps: Any, width: int,
                    request_k: Any, num_requests: int, num_rows: int, cu: Any | None = None) -> None:
        """`render` on a GPU into rendered_size(num_rows, width) int64 at a device address, on the
        current stream; the arrays may be given as device addresses (int). One kernel launch,
        cuda/logprob_json.cu."""
        if not num_rows:
            return
        capacity = self.vocab.capacity(num_rows, width)
        blocks = -(-num_rows * (width + 1) // SLOTS_PER_BLOCK)
        load_kernel("logprob_json", "render_chat_logprobs")((blocks,), (THREADS,), tuple(
            np.uint64(a) if isinstance(a, int) else a for a in (
                token_ids, logprobs, top_ids, top_lps, np.int32(width), request_k, 0 if cu is None else cu,
                np.int32(num_requests), np.int32(num_rows), *self.table, address + 8 * num_rows,
                np.int64(capacity), address)))

    def entries(self, rendered: np.ndarray, num_rows: int, bounds: list[tuple[int, int] | None],
                rows: Callable[[], tuple[Any, ...]]) -> list[LogprobsJSON | None]:
        """Each request's entries from the host copy of a render of num_rows rows: bounds[b] = its
        rows (lo, hi), ascending with b, or None for none. Entries that outgrew the device's capacity are rendered
        again here, from rows() = render's arguments from token_ids on, on the host."""
        last = next((rows[1] for rows in reversed(bounds) if rows is not None), 0)  # rows ascend
        if last and rendered[last - 1] > 8 * (len(rendered) - num_rows):
            rendered = self.render(np, *rows())
        row_ends = rendered[:last].tolist()
        data = memoryview(rendered[num_rows:].view(np.uint8)[:row_ends[-1] if last else 0].tobytes())
        return _split(data, row_ends, bounds)


def _split(data: memoryview, row_ends: list[int], bounds: list[tuple[int, int] | None]) -> list[LogprobsJSON | None]:
    """data cut at row_ends into each request's entries (bounds as in LogprobRenderer.entries)."""
    result: list[LogprobsJSON | None] = []
    for rows in bounds:
        if rows is None:
            result.append(None)
            continue
        lo, hi = rows
        start = row_ends[lo - 1] if lo else 0
        result.append(LogprobsJSON(data[start:row_ends[hi - 1]] if hi > lo else b"", row_ends[lo:hi], start))
    return result


def _render_numpy(vocab: VocabJSON, token_ids: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray,
                  top_lps: np.ndarray, request_k: np.ndarray, num_rows: int,
                  cu: np.ndarray | None) -> tuple[np.ndarray, bytes]:
    """The twin of render_chat_logprobs: the row ends [N] int64 and every entry's bytes."""
    entries, ends = [], np.zeros(num_rows, dtype=np.int64)
    at = 0
    for r in range(int(cu[-1]) if cu is not None else num_rows):
        b = int(np.searchsorted(cu, r, side="right")) - 1 if cu is not None else r
        k = int(request_k[b])
        if k >= 0:
            tops = [_entry(vocab, int(top_ids[r, j]), float(top_lps[r, j])) + b"}" for j in range(k)]
            entries.append(_entry(vocab, int(token_ids[r]), float(logprobs[r])) + b',"top_logprobs":['
                           + b",".join(tops) + b"]},")
            at += len(entries[-1])
        ends[r] = at
    return ends, b"".join(entries)


def _entry(vocab: VocabJSON, token_id: int, logprob: float) -> bytes:
    """{"token":T,"logprob":X,"bytes":B   (the rest is the caller's)"""
    text, raw = vocab.token_json(token_id)
    return b'{"token":' + text + b',"logprob":' + format_logprob(logprob) + b',"bytes":' + raw


def _power_of_ten(e: int) -> float:
    """The double nearest 10**e, as a C literal `1e<e>` gives it (the kernel's tables)."""
    return float(f"1e{e}")


def format_logprob(value: float) -> bytes:
    """A float32 logprob as the kernel writes it (see the module's docstring)."""
    value = float(value)  # float64 arithmetic, as the kernel's, for NumPy scalars too
    if not value > MIN_LOGPROB:
        return b"-9999.0"
    if value == 0.0:
        return b"0.0"
    sign, a = ("-", -value) if value < 0 else ("", value)
    e = math.floor(math.log10(a))  # then exactly: the largest e with 10^e <= a, by the kernel's table
    while _power_of_ten(e) > a:
        e -= 1
    while _power_of_ten(e + 1) <= a:
        e += 1
    m = round(a * _power_of_ten(SIGNIFICANT_DIGITS - 1 - e))  # 9 digits, rounded half to even like rint
    if m >= 10 ** SIGNIFICANT_DIGITS:
        m, e = m // 10, e + 1
    digits = str(m).rstrip("0")
    if e < -4:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mantissa}e-{-e:02d}".encode()
    if e >= 0:
        return f"{sign}{digits[:e + 1].ljust(e + 1, '0')}.{digits[e + 1:] or '0'}".encode()
    return f"{sign}0.{'0' * (-e - 1)}{digits}".encode()
