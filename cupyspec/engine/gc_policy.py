"""Garbage-collector settings for a serving process: fewer, cheaper collections."""

from __future__ import annotations

import gc

# Young objects are collected every 100,000 net allocations instead of CPython's 700. The engine
# allocates a few small records per token (and suffix decoding a trie node per token and suffix),
# almost all freed by reference counting, so frequent collections spend the host's step time on
# scans that free nearly nothing. Cyclic garbage waits longer, bounded by that many objects.
THRESHOLDS = (100_000, 50, 100)


def settle_garbage_collector() -> None:
    """Freeze what is alive now (it lives as long as the process: full collections would rescan
    the whole start-up heap) and collect young objects less often. Call once, after start-up."""
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
