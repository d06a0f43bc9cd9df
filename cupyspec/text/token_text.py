"""Each token's display string and raw bytes, as the OpenAI logprob formats show them."""

from __future__ import annotations

from typing import Protocol


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


class TokenText:
    """Token ids to their display strings and raw bytes, cached (the vocabulary is bounded). A token
    that is part of a multi-byte character shows its bytes, as vLLM shows them: `bytes:\\xe2\\x80`."""

    def __init__(self, tokenizer: TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def entry(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of the token; the bytes list is shared: do not change it."""
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._tokenizer.token_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token_id] = (text, list(raw))
        return entry

    def text(self, token_id: int) -> str:
        return self.entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self.entry(token_id)[1]
