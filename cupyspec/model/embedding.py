"""Token embedding, with input ids that may name a token the previous step sampled on the device."""

from __future__ import annotations

from typing import Any

import numpy as np

from cupyspec.kernels import load_kernel

THREADS = 128


def embed_tokens(xp: Any, table: Any, ids: Any, previous: Any, first: int | None = None) -> Any:
    """The fp32 rows [T, H] of table [V, H] for ids [T] int32, where an id ~s < 0 stands for previous[s].

    previous [S] int32 holds the tokens the step before sampled, still on the device (overlap
    scheduling feeds them to the next step without a round trip through the host). first: where
    table holds a slice of the vocabulary (a tensor-parallel rank's), the id of its row 0; ids
    outside the slice get zeros. On a GPU with fp16 weights and the whole vocabulary this is
    cuda/embedding.cu; these lines are its twin.
    """
    num_tokens, hidden = len(ids), table.shape[1]
    if first is not None or xp is np or table.dtype != np.float16 or hidden % 2:
        resolved = xp.where(ids < 0, previous[xp.maximum(~ids, 0)], ids)  # [T]
        if first is None:
            return table[resolved].astype(np.float32)
        local = resolved - first  # [T]
        mine = (local >= 0) & (local < table.shape[0])  # [T]
        return table[xp.where(mine, local, 0)].astype(np.float32) * mine[:, None]
    out = xp.empty((num_tokens, hidden), dtype=np.float32)
    if num_tokens:
        load_kernel("embedding", "embed_tokens")((num_tokens,), (THREADS,),
                                                 (table, ids, previous, out, np.int32(hidden)))
    return out
