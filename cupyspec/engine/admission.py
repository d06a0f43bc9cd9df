"""A request's admission: its prompt and token ids checked against the model's vocabulary, its context
length and the KV pool's capacity, before it takes any engine state."""

from __future__ import annotations

import numpy as np

from cupyspec.errors import InvalidRequestError
from cupyspec.sampling.params import SamplingParams


def check_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  kv_capacity: int) -> None:
    """Raise InvalidRequestError, naming the field at fault, for a prompt or stop token outside the
    vocabulary, or a prompt plus max_tokens beyond the context length or the pool's kv_capacity tokens."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", "prompt")
    for field, ids in (("prompt", token_ids), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})", field)
    total = len(token_ids) + (params.max_tokens or 1)
    if total > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{total} ({len(token_ids)} in the prompt, {params.max_tokens or 1} to generate)", "max_tokens")
    if total > kv_capacity:
        raise InvalidRequestError(f"the request needs {total} tokens of KV cache; the pool holds {kv_capacity}",
                                  "max_tokens")
