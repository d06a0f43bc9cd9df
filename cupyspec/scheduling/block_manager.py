"""Paged KV block accounting: reference counts, a free list and prefix caching (no arrays)."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from cupyspec.scheduling.sequence import Sequence


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """Chained key of a full block: 128-bit BLAKE2b of the parent block's key and the token ids."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class _SeqState:
    """Prefix-cache bookkeeping of one sequence."""

    hashes: list[bytes] = field(default_factory=list)  # keys of its leading full, accepted blocks
    hit_tokens: int = 0  # counted by its last lookup
    query_tokens: int = 0


class BlockManager:
    """Hands out KV blocks 0..num_blocks-1 to sequences and shares full blocks by content.

    A block is free (no owner, no key), in use (reference count > 0), or evictable
    (no owner, but still registered under its key, so a later prefix hit revives it;
    evicted least recently used first when no free block remains).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 keys_include_next_token: bool = False) -> None:
        """keys_include_next_token: a block's key covers the token after it too, and a block is cached
        only once that token is known: an MTP head's K/V at a position depends on the next token."""
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_tokens = block_size + int(keys_include_next_token)  # tokens a block's key covers
        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._block_of_key: dict[bytes, int] = {}
        self._key_of_block: dict[int, bytes] = {}
        self._seqs: dict[int, _SeqState] = {}  # by seq_id
        self._held: Counter[int] = Counter()  # references `hold` took, by block
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def allocate_for_prefill(self, seq: Sequence) -> None:
        """Reference the longest cached prefix of `seq` (no blocks yet); set num_computed_tokens to it."""
        if seq.block_ids:
            raise ValueError("allocate_for_prefill needs a sequence without blocks")
        state = _SeqState()
        self._seqs[seq.seq_id] = state
        seq.num_computed_tokens = 0
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return
        token_ids = seq.token_ids
        # At least one token must be computed so that the model yields next-token logits.
        max_cached_blocks = (len(token_ids) - 1) // self.block_size
        parent = b""
        for i in range(max_cached_blocks):
            key = block_hash(parent, token_ids[i * self.block_size:i * self.block_size + self.key_tokens])
            block = self._block_of_key.get(key)
            if block is None:
                break
            self._take(block)
            seq.block_ids.append(block)
            state.hashes.append(key)
            parent = key
        seq.num_computed_tokens = len(seq.block_ids) * self.block_size
        state.hit_tokens = seq.num_computed_tokens
        state.query_tokens = len(token_ids)
        self.num_prefix_hit_tokens += state.hit_tokens
        self.num_prefix_query_tokens += state.query_tokens

    def cancel_prefill(self, seq: Sequence) -> None:
        """Undo allocate_for_prefill (and any slots since): references and hit counters."""
        state = self._seqs.get(seq.seq_id)
        if state is not None:
            self.num_prefix_hit_tokens -= state.hit_tokens
            self.num_prefix_query_tokens -= state.query_tokens
        self.free(seq)

    def ensure_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Cover positions [0, num_computed_tokens + num_new_tokens) with blocks; all or nothing."""
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        missing = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        if missing <= 0:
            return True
        if not self.can_allocate(missing):
            return False
        self._seqs.setdefault(seq.seq_id, _SeqState())
        # in ascending order (eviction hands a freed sequence's blocks back tail first): a prompt's
        # blocks then lie in runs, each of which moves between pools as one region (cupyspec/disagg/)
        seq.block_ids.extend(sorted(self._fresh_block() for _ in range(missing)))
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are full of computed (accepted) tokens."""
        if not self.enable_prefix_caching:
            return
        if seq.num_computed_tokens > seq.num_tokens:
            raise ValueError("num_computed_tokens exceeds the sequence's tokens")
        state = self._seqs[seq.seq_id]
        known = seq.num_known_tokens  # (a step in flight holds places for tokens the host has not seen)
        num_full = min(seq.num_computed_tokens, known - self.key_tokens + self.block_size) // self.block_size
        if len(state.hashes) >= num_full:
            return
        parent = state.hashes[-1] if state.hashes else b""
        for i in range(len(state.hashes), num_full):
            key = block_hash(parent, seq.tokens(i * self.block_size, i * self.block_size + self.key_tokens))
            state.hashes.append(key)
            parent = key
            block = seq.block_ids[i]
            assert block not in self._key_of_block, "a fresh block is already registered"
            if key not in self._block_of_key:  # else an identical block exists: keep that one
                self._block_of_key[key] = block
                self._key_of_block[block] = key

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the KV of the first `num_tokens` positions; whole blocks past them return to the pool."""
        if num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        keep = self.blocks_for(num_tokens)
        state = self._seqs.get(seq.seq_id)
        assert state is None or len(state.hashes) * self.block_size <= num_tokens, \
            "truncating into registered (accepted) blocks"
        for block in reversed(seq.block_ids[keep:]):
            self._release(block)
        del seq.block_ids[keep:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def free(self, seq: Sequence) -> None:
        """Drop every reference of `seq`; its registered blocks stay cached as evictable."""
        for block in reversed(seq.block_ids):  # the tail is evicted before the shared head
            self._release(block)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        self._seqs.pop(seq.seq_id, None)

    def hold(self, block_ids: Seq[int]) -> tuple[int, ...]:
        """Take another reference to blocks a sequence holds, kept until `release`: their K/V outlives
        the sequence (a prefill server's prompt, until a decode server has read it)."""
        for block in block_ids:
            if not self._refcount[block]:
                raise ValueError(f"block {block} is not in use: only blocks a sequence holds can be held")
            self._take(block)
        self._held.update(block_ids)
        return tuple(block_ids)

    def release(self, block_ids: Seq[int]) -> None:
        """Drop the references `hold` took."""
        if any(self._held[block] < count for block, count in Counter(block_ids).items()):
            raise ValueError("releasing blocks that were not held")
        self._held.subtract(block_ids)
        self._held = +self._held  # (drops the counts that reached zero)
        for block in reversed(block_ids):
            self._release(block)

    def check_invariants(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the books agree with the blocks held by `live` sequences."""
        expected = [0] * self.num_blocks
        live_ids = set()
        for seq in live:
            live_ids.add(seq.seq_id)
            _check(len(set(seq.block_ids)) == len(seq.block_ids), f"seq {seq.seq_id} holds a block twice")
            _check(len(seq.block_ids) >= self.blocks_for(seq.num_computed_tokens),
                   f"seq {seq.seq_id} has computed tokens outside its blocks")
            for block in seq.block_ids:
                expected[block] += 1
        for block, count in self._held.items():
            expected[block] += count
        _check(expected == self._refcount, "reference counts differ from the blocks held")
        _check(set(self._seqs) <= live_ids, "state kept for a sequence that is not live")
        free, evictable = set(self._free), set(self._evictable)
        _check(len(free) == len(self._free), "a block is free twice")
        _check(not free & evictable, "a block is both free and evictable")
        unowned = {b for b in range(self.num_blocks) if self._refcount[b] == 0}
        _check(free | evictable == unowned, "unowned blocks differ from free + evictable")
        _check(not free & set(self._key_of_block), "a free block is still registered")
        _check(evictable <= set(self._key_of_block), "an evictable block is not registered")
        _check({b: k for k, b in self._block_of_key.items()} == self._key_of_block,
               "the key maps are not inverse")

    def _take(self, block: int) -> None:
        """Add a reference to a cached block, reviving it if it was evictable."""
        if self._refcount[block] == 0:
            del self._evictable[block]
        self._refcount[block] += 1

    def _fresh_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_key[self._key_of_block.pop(block)]
        self._refcount[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refcount[block] -= 1
        assert self._refcount[block] >= 0, f"block {block} released more often than taken"
        if self._refcount[block] == 0:
            if block in self._key_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
