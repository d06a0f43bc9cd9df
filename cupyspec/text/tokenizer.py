"""Byte-level BPE tokenizer built from GGUF metadata or an HF tokenizer.json, with chat templates."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Pre-tokenizer regexes of llama.cpp (src/llama-vocab.cpp), applied one after the other.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3")
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"), (_QWEN2,)),
    **dict.fromkeys((*_LLAMA3_NAMES, "dbrx", "smaug-bpe"), (_LLAMA3,)),
}
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types


@lru_cache(maxsize=1)
def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable character standing for a byte back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    """Encodes text to token ids and back; knows the special tokens and the chat template."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool = False,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        if add_bos and bos_token_id is None:
            raise ValueError("add_bos needs a bos_token_id")
        self._hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.bos_token = bos_token if bos_token is not None else self._text_of(bos_token_id)
        self.eos_token = eos_token if eos_token is not None else self._text_of(next(iter(self.eos_token_ids), None))
        added = hf.get_added_tokens_decoder()
        self._added_text = {i: t.content for i, t in added.items()}
        self._special = frozenset(i for i, t in added.items() if t.special)
        parts = (c.__getstate__() for c in (hf.decoder, hf.pre_tokenizer) if c is not None)
        self._byte_level = any(b'"ByteLevel"' in p for p in parts)  # else SentencePiece-style pieces
        self._bytes_cache: dict[int, bytes] = {}

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (shared, not a copy)."""
        return self._hf

    def _text_of(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._hf.id_to_token(token_id) or "")

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF `tokenizer.ggml.*` metadata (byte-level BPE, model 'gpt2', only)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer.ggml.model {kind!r} is unsupported (supported: 'gpt2', byte-level BPE)"
            )
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZER_REGEXES:
            known = ", ".join(sorted(PRE_TOKENIZER_REGEXES))
            raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is unsupported (supported: {known})")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
        merges = []
        for m in meta.get("tokenizer.ggml.merges", []):
            cut = m.find(" ", 1)  # as llama.cpp: a merge's left part may itself start with a space
            if cut < 0:
                raise ValueError(f"GGUF tokenizer.ggml.merges entry {m!r} has no space")
            merges.append((m[:cut], m[cut + 1 :]))
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre in _LLAMA3_NAMES)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_REGEXES[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        )
        hf.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if "tokenizer.ggml.eos_token_id" not in meta:
            raise ValueError("GGUF metadata lacks tokenizer.ggml.eos_token_id")
        eos = [int(meta["tokenizer.ggml.eos_token_id"])]
        if "tokenizer.ggml.eot_token_id" in meta:
            eos.append(int(meta["tokenizer.ggml.eot_token_id"]))
        return cls(
            hf,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(
        cls, path: Path, *, bos_token_id: int | None = None, eos_token_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """Build from tokenizer.json and tokenizer_config.json (and chat_template.jinja) in `path`.

        bos/eos ids default to those of tokenizer_config.json's bos_token/eos_token.
        """
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{path}: tokenizer.json is missing")
        hf = HFTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        bos_token, eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if bos_token_id is None and bos_token is not None:
            bos_token_id = hf.token_to_id(bos_token)
        if not eos_token_ids and eos_token is not None and hf.token_to_id(eos_token) is not None:
            eos_token_ids = (hf.token_to_id(eos_token),)
        if not eos_token_ids:
            raise ValueError(f"{path}: no eos token id in config.json nor an eos_token in tokenizer_config.json")
        return cls(
            hf,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=_hf_chat_template(path, config),
            bos_token=bos_token,
            eos_token=eos_token,
        )

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become single tokens."""
        ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 at the edges becomes U+FFFD)."""
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token `token_id` stands for."""
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self._added_text:
            out = self._added_text[token_id].encode()
        else:
            piece = self._hf.id_to_token(token_id)
            if piece is None:
                raise ValueError(f"token_id {token_id} is outside the vocabulary (size {self.vocab_size})")
            out = _byte_level_bytes(piece) if self._byte_level else _sentencepiece_bytes(piece)
        self._bytes_cache[token_id] = out
        return out

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a control/special token (skipped when decoding)."""
        return token_id in self._special

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("the model has no chat template; use a completion prompt instead")
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from e


def _byte_level_bytes(piece: str) -> bytes:
    table = gpt2_byte_decoder()
    return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def _token_text(entry: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return entry.get("content") if isinstance(entry, dict) else entry


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
