"""BlockManager: allocation, prefix caching, eviction, truncation."""

from __future__ import annotations

import pytest

from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.block_manager import BlockManager
from cupyspec.scheduling.sequence import Sequence


def make_seq(prompt: list[int], params: SamplingParams = SamplingParams()) -> Sequence:
    return Sequence(request_id="r", choice_index=0, prompt_token_ids=list(prompt), params=params,
                    max_total_tokens=len(prompt) + 64, arrival_time=0.0, sampling_key=0)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and compute the whole remaining prompt in one step."""
    bm.allocate_for_prefill(seq)
    assert bm.ensure_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_prefix_hits_share_blocks_and_refcounts():
    bm = BlockManager(16, 16, enable_prefix_caching=True)
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a, b = make_seq(prompt), make_seq(prompt)
    prefill(bm, a)
    assert len(a.block_ids) == 3 and bm.num_used_blocks == 3
    bm.allocate_for_prefill(b)
    assert b.num_computed_tokens == 32
    assert b.block_ids == a.block_ids[:2]
    assert bm.ensure_slots(b, 8)
    assert b.block_ids[2] != a.block_ids[2]
    assert bm.num_used_blocks == 4
    assert (bm.num_prefix_hit_tokens, bm.num_prefix_query_tokens) == (32, 80)
    bm.check_invariants([a, b])
    bm.free(a)
    bm.check_invariants([b])
    assert bm.num_used_blocks == 3  # the shared two are still held by b
    bm.free(b)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 16
    bm.check_invariants([])


def test_different_prefix_does_not_hit():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = make_seq([1, 2, 3, 4, 0, 6, 7, 8, 9])  # first block equal, second differs
    bm.allocate_for_prefill(other)
    assert other.num_computed_tokens == 4


def test_cache_leaves_at_least_one_token_to_compute():
    bm = BlockManager(16, 16, enable_prefix_caching=True)
    prompt = list(range(32))  # exactly two full blocks
    a = make_seq(prompt)
    prefill(bm, a)
    b = make_seq(prompt)
    bm.allocate_for_prefill(b)
    assert b.num_computed_tokens == 16 and b.num_uncomputed_tokens == 16
    c = make_seq(prompt[:33] + [7])  # 33 tokens: both blocks may be reused
    bm.allocate_for_prefill(c)
    assert c.num_computed_tokens == 32


def test_prompt_logprobs_and_disabled_caching_skip_lookup():
    prompt = list(range(40))
    bm = BlockManager(16, 16, enable_prefix_caching=True)
    prefill(bm, make_seq(prompt))
    echo = make_seq(prompt, SamplingParams(prompt_logprobs=1))
    bm.allocate_for_prefill(echo)
    assert echo.num_computed_tokens == 0 and echo.block_ids == []
    off = BlockManager(16, 16, enable_prefix_caching=False)
    prefill(off, make_seq(prompt))
    again = make_seq(prompt)
    off.allocate_for_prefill(again)
    assert again.num_computed_tokens == 0


def test_evictable_blocks_reused_on_hit_then_evicted_under_pressure():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    prompt = list(range(9))  # 2 full blocks + 1
    a = make_seq(prompt)
    prefill(bm, a)
    cached = a.block_ids[:2]
    bm.free(a)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 4
    b = make_seq(prompt)
    bm.allocate_for_prefill(b)  # revives both evictable blocks
    assert b.block_ids == cached and b.num_computed_tokens == 8
    bm.check_invariants([b])
    bm.free(b)
    # A different 16-token prompt needs all 4 blocks: the 2 free ones, then both evictable ones.
    c = make_seq(list(range(50, 66)))
    bm.allocate_for_prefill(c)
    assert c.num_computed_tokens == 0
    assert bm.ensure_slots(c, 16)
    assert set(cached) <= set(c.block_ids)
    bm.check_invariants([c])
    bm.free(c)
    d = make_seq(prompt)
    bm.allocate_for_prefill(d)
    assert d.num_computed_tokens == 0  # the old prefix was evicted


def test_lru_evicts_tail_blocks_first():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = make_seq(list(range(13)))  # 3 full blocks + 1
    prefill(bm, a)
    bm.free(a)  # tail blocks become the least recently used
    filler = make_seq([99] * 5)  # needs 2 fresh blocks: the free one and the oldest evictable
    bm.allocate_for_prefill(filler)
    assert bm.ensure_slots(filler, 5)
    b = make_seq(list(range(13)))
    bm.allocate_for_prefill(b)
    assert b.num_computed_tokens == 8  # blocks 0 and 1 of the prefix survived, block 2 did not


def test_a_prompt_takes_reused_blocks_in_ascending_order():
    """Eviction hands a freed prompt's blocks back tail first; the next prompt takes them in order, so
    that they stay one run of consecutive blocks (which a K/V transfer moves as one region)."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    first = make_seq(list(range(32)))  # all 8 blocks, registered, then evictable
    prefill(bm, first)
    bm.free(first)
    second = make_seq([100 + t for t in range(32)])  # shares nothing: evicts all 8
    prefill(bm, second)
    assert second.block_ids == sorted(second.block_ids) == list(range(8))


def test_ensure_slots_is_all_or_nothing():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a = make_seq(list(range(8)))
    bm.allocate_for_prefill(a)
    assert bm.ensure_slots(a, 8) and len(a.block_ids) == 2
    b = make_seq(list(range(12)))
    bm.allocate_for_prefill(b)
    assert not bm.ensure_slots(b, 12)  # needs 3, only 2 free
    assert b.block_ids == [] and bm.num_free_blocks == 2
    assert bm.ensure_slots(b, 8) and len(b.block_ids) == 2
    assert bm.ensure_slots(a, 8)  # already covered: nothing needed
    assert not bm.can_allocate(1)
    bm.check_invariants([a, b])


def test_truncate_frees_whole_blocks_past_the_end():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = make_seq(list(range(6)))
    prefill(bm, seq)  # 6 tokens in 2 blocks, block 0 registered
    seq.output_token_ids += [1, 2, 3, 4, 5, 6]  # pretend drafts: 12 tokens
    assert bm.ensure_slots(seq, 6) and len(seq.block_ids) == 3
    seq.num_computed_tokens = 12
    kept = seq.block_ids[:2]
    bm.truncate(seq, 7)  # rejected drafts past position 7
    assert seq.block_ids == kept and seq.num_computed_tokens == 7
    assert bm.num_used_blocks == 2
    bm.truncate(seq, 4)
    assert len(seq.block_ids) == 1
    bm.check_invariants([seq])
    with pytest.raises(AssertionError):
        bm.truncate(seq, 3)  # would cut a registered block


def test_commit_keeps_existing_mapping_for_duplicate_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    prompt = list(range(9))
    a, b = make_seq(prompt), make_seq(prompt)
    for seq in (a, b):  # both miss, then both compute the same blocks
        bm.allocate_for_prefill(seq)
        assert bm.ensure_slots(seq, 9)
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.commit(seq)
    bm.check_invariants([a, b])
    bm.free(b)  # b's duplicates are unregistered: they become truly free
    assert bm.num_free_blocks == 5
    c = make_seq(prompt)
    bm.allocate_for_prefill(c)
    assert c.block_ids == a.block_ids[:2]


def test_commit_only_registers_computed_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_seq(list(range(12)))
    bm.allocate_for_prefill(a)
    assert bm.ensure_slots(a, 12)
    a.num_computed_tokens = 7  # one full computed block
    bm.commit(a)
    b = make_seq(list(range(12)))
    bm.allocate_for_prefill(b)
    assert b.num_computed_tokens == 4


def test_check_invariants_detects_a_leak():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a = make_seq(list(range(5)))
    bm.allocate_for_prefill(a)
    assert bm.ensure_slots(a, 5)
    with pytest.raises(AssertionError):
        bm.check_invariants([])


def test_a_block_manager_without_blocks_or_block_size_is_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16, True)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0, True)
