"""Scheduler: chunked prefill, mixed batches, limits, preemption, fairness, a random workload."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cupyspec.config import SchedulerConfig
from cupyspec.sampling.params import SamplingParams
from cupyspec.scheduling.block_manager import BlockManager
from cupyspec.scheduling.scheduler import Scheduler, SchedulerOutput
from cupyspec.scheduling.sequence import Sequence, SequenceStatus

_clock = itertools.count()


def make_seq(prompt_len: int, max_new: int = 1000, first_token: int = 0,
             prompt: list[int] | None = None) -> Sequence:
    """A new sequence; its prompt is `prompt`, or `prompt_len` consecutive ids from `first_token`."""
    if prompt is None:
        prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(request_id="r", choice_index=0, prompt_token_ids=prompt,
                    params=SamplingParams(), max_total_tokens=len(prompt) + max_new,
                    arrival_time=float(next(_clock)), sampling_key=0)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, caching: bool = True, max_model_len: int = 4096) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(num_blocks, block_size, caching), max_model_len)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step: schedule, mark computed, append a token to each sampling sequence."""
    out = sched.schedule()
    sched.on_launched(out)
    sched.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.output_token_ids.append(token)
    sched.check_invariants()
    return out


def segments(out: SchedulerOutput) -> dict[int, int]:
    return {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}


def test_chunked_prefill_of_a_long_prompt():
    sched = make_scheduler(budget=16)
    seq = make_seq(40)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = step(sched)
        assert out.num_tokens <= 16
        (item,) = out.scheduled
        chunks.append((item.num_computed_before, item.num_new_tokens, item.samples))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert seq.num_computed_tokens == 40 and seq.output_token_ids == [7]
    (item,) = step(sched).scheduled
    assert (item.num_computed_before, item.num_new_tokens, item.samples) == (40, 1, True)
    assert item.token_ids == [7]


def test_mixed_decode_and_prefill_in_one_step():
    sched = make_scheduler(budget=10)
    a = make_seq(5)
    sched.add(a)
    step(sched)  # a prefilled, now decoding
    b = make_seq(30, first_token=100)
    sched.add(b)
    out = step(sched)
    assert segments(out) == {a.seq_id: 1, b.seq_id: 9}
    assert [i.seq for i in out.scheduled] == [a, b]
    assert out.scheduled[1].token_ids == list(range(100, 109))
    assert out.num_tokens == 10


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, first_token=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = step(sched)
    assert [i.seq for i in out.scheduled] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 1
    sched.finish(seqs[0], "stop")
    out = step(sched)
    assert [i.seq for i in out.scheduled] == seqs[1:]


def test_preemption_of_the_latest_arrival_and_full_recompute():
    # 6 blocks of 4: two 8-token prompts fill 4; both grow until the pool is exhausted.
    sched = make_scheduler(num_blocks=6, block_size=4, caching=False)
    a, b = make_seq(8), make_seq(8, first_token=50)
    sched.add(a)
    sched.add(b)
    preempted_at = None
    for n in range(8):
        out = step(sched, token=n)
        if out.preempted:
            preempted_at = n
            break
    assert out.preempted == (b,) and preempted_at is not None
    assert segments(out) == {a.seq_id: 1}
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.num_preemptions == 1
    c = make_seq(2, first_token=90)
    sched.add(c)
    step(sched)
    assert list(sched.waiting) == [b, c]  # b stays at the head
    sched.finish(a, "stop")
    out = step(sched)
    item = out.scheduled[0]
    assert item.seq is b and item.num_computed_before == 0
    assert item.token_ids == b.prompt_token_ids + b.output_token_ids[:-1]  # prompt and output
    assert len(b.output_token_ids) == preempted_at + 1  # its output resumes after the recompute


def test_no_admission_in_a_step_that_preempted():
    # With budget left, b would come back at once with a short chunk and be preempted again.
    sched = make_scheduler(num_blocks=6, block_size=4, caching=False, budget=4)
    a, b = make_seq(8), make_seq(8, first_token=50)
    sched.add(a)
    sched.add(b)
    for _ in range(12):
        out = step(sched)
        if out.preempted:
            break
    assert out.preempted == (b,) and segments(out) == {a.seq_id: 1}
    assert b.block_ids == [] and list(sched.waiting) == [b]


def test_resumed_sequence_hits_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=6, block_size=4, caching=True)
    a, b = make_seq(8), make_seq(8, first_token=50)
    sched.add(a)
    sched.add(b)
    while not step(sched).preempted:
        pass
    sched.finish(a, "stop")
    item = step(sched).scheduled[0]
    assert item.seq is b and item.num_computed_before > 0
    assert item.num_computed_before % 4 == 0 and item.num_new_tokens >= 1


def test_lone_sequence_exhausting_the_pool_finishes_with_length():
    sched = make_scheduler(num_blocks=2, block_size=4)
    seq = make_seq(6)
    sched.add(seq)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        sched.add(make_seq(9))
    finished = []
    for _ in range(5):
        out = step(sched)
        finished += out.finished
    assert finished == [seq] and seq.finish_reason == "length"
    assert seq.num_tokens == 9  # 8 positions of KV held, the 9th token had no room
    assert not sched.has_work and sched.block_manager.num_used_blocks == 0


def test_fcfs_long_prompt_is_not_starved():
    sched = make_scheduler(num_blocks=12, block_size=4, budget=64, caching=False)
    rng = np.random.default_rng(1)
    for t in range(5):
        sched.add(make_seq(4, first_token=10 * t))
        step(sched)
    long = make_seq(40, first_token=1000)  # 10 of the 12 blocks
    sched.add(long)
    blocked_steps = 0
    for t in range(5, 200):
        sched.add(make_seq(4, first_token=10 * t))  # short prompts keep coming
        admitted = [i.seq for i in step(sched).scheduled if i.num_computed_before == 0]
        if long.status is SequenceStatus.RUNNING:
            break
        assert admitted == []  # nobody overtakes the waiting head
        blocked_steps += 1
        for s in list(sched.running):
            if rng.random() < 0.5:
                sched.finish(s, "stop")
    assert long.status is SequenceStatus.RUNNING and blocked_steps > 0


def test_no_block_leaked_after_everything_finishes():
    sched = make_scheduler(num_blocks=20, block_size=4, budget=16)
    seqs = [make_seq(n, max_new=5, first_token=3 * n) for n in (3, 9, 17, 30)]
    for s in seqs:
        sched.add(s)
    for _ in range(100):
        step(sched)
        for s in list(sched.running):
            if s.num_tokens >= s.max_total_tokens:
                sched.finish(s, "length")
        if not sched.has_work:
            break
    assert not sched.has_work and all(s.is_finished for s in seqs)
    bm = sched.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])


def test_lookahead_reserves_slots_and_budget():
    class Lookahead(Scheduler):
        def num_lookahead_tokens(self, seq: Sequence) -> int:
            return 3

    sched = Lookahead(SchedulerConfig(max_num_batched_tokens=32), BlockManager(16, 4, True), 4096)
    seq = make_seq(5)
    sched.add(seq)
    step(sched)
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.num_lookahead_tokens, out.num_tokens) == (1, 3, 4)
    assert len(seq.block_ids) * 4 >= seq.num_computed_tokens + 4 > 8  # a third block for the drafts


def test_drafts_are_cut_to_keep_a_step_within_its_cuda_graph():
    """Six decoding sequences with 3 drafts each are 24 rows; with a 9-token prompt beside them and
    graphs of up to 24 rows, the drafts give up 9 rows (each keeps 1, the first three 2), and the
    step fits its graph. A step too long for a graph even without drafts keeps them all."""
    def scheduler(graph_rows: int) -> Scheduler:
        class Drafting(Scheduler):
            def num_lookahead_tokens(self, seq: Sequence) -> int:
                return 3 if seq.output_token_ids else 0

        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
        return Drafting(config, BlockManager(64, 4, True), 4096, graph_rows=graph_rows)

    for graph_rows, prompt, drafts in ((24, 9, [2, 2, 2, 1, 1, 1]), (24, 19, [3] * 6), (0, 9, [3] * 6),
                                       (30, 6, [3] * 6)):
        sched = scheduler(graph_rows)
        for _ in range(6):
            sched.add(make_seq(2))
        step(sched)
        sched.add(make_seq(prompt))
        out = sched.schedule()
        assert [item.num_lookahead_tokens for item in out.scheduled[:6]] == drafts
        assert out.scheduled[6].num_new_tokens == prompt
        if graph_rows and drafts != [3] * 6:
            assert out.num_tokens == graph_rows
        sched.on_launched(out)
        sched.update_after_step(out)
        sched.check_invariants()


def test_drafts_are_cut_to_keep_a_step_within_its_cuda_graphs_rows_of_logits():
    """Graphs of up to 64 rows, but of at most 10 rows of logits: six decoding sequences with 3 drafts
    each and a 19-token prompt are 43 rows, and ask for up to 7 + 18 rows of logits; the drafts keep
    3 rows of logits (the first three sequences 1 each, the others none)."""
    class Drafting(Scheduler):
        def num_lookahead_tokens(self, seq: Sequence) -> int:
            return 3 if seq.output_token_ids else 0

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Drafting(config, BlockManager(64, 4, True), 4096, graph_rows=64, graph_logit_rows=10)
    for _ in range(6):
        sched.add(make_seq(2))
    step(sched)
    sched.add(make_seq(19))
    out = sched.schedule()
    assert [item.num_lookahead_tokens for item in out.scheduled[:6]] == [1, 1, 1, 0, 0, 0]
    assert out.scheduled[6].num_new_tokens == 19
    sched.on_launched(out)
    sched.update_after_step(out)
    sched.check_invariants()


def test_random_workload_keeps_invariants():
    rng = np.random.default_rng(0)
    block_size = 4
    sched = make_scheduler(num_blocks=24, block_size=block_size, max_num_seqs=6, budget=24)
    kv = np.full((24, block_size), -1, dtype=np.int64)  # token id whose K/V each slot holds
    prefixes = [list(rng.integers(0, 50, size=12)) for _ in range(3)]
    num_finished = 0
    for t in range(500):
        if rng.random() < 0.4 and sched.num_waiting < 8:
            n = int(rng.integers(1, 40))
            prompt = (prefixes[int(rng.integers(3))] + list(rng.integers(0, 50, size=n)))[:n]
            sched.add(make_seq(0, max_new=int(rng.integers(1, 20)), prompt=[int(x) for x in prompt]))
        out = sched.schedule()
        assert out.num_tokens <= 24 and len(out.scheduled) <= 6
        for item in out.scheduled:
            seq, start = item.seq, item.num_computed_before
            tokens = seq.token_ids
            positions = np.arange(start + item.num_new_tokens)
            slots = np.array(seq.block_ids)[positions // block_size], positions % block_size
            assert np.array_equal(kv[slots][:start], tokens[:start])  # cached prefix holds our tokens
            kv[slots[0][start:], slots[1][start:]] = tokens[start:start + item.num_new_tokens]
        sched.on_launched(out)
        sched.update_after_step(out)
        for item in out.scheduled:
            if item.samples and not item.seq.is_finished:
                item.seq.output_token_ids.append(int(rng.integers(0, 50)))
        for seq in list(sched.running):
            if seq.num_tokens >= seq.max_total_tokens or rng.random() < 0.03:
                sched.finish(seq, "stop")
                num_finished += 1
        if sched.waiting and rng.random() < 0.02:
            sched.abort(sched.waiting[-1])
        sched.check_invariants()
    assert num_finished > 50 and sched.num_preemptions > 0
    assert sched.block_manager.num_prefix_hit_tokens > 0
    for seq in list(sched.running) + list(sched.waiting):
        sched.finish(seq, "abort")
    assert sched.block_manager.num_used_blocks == 0


def test_a_received_prompt_reuses_its_cached_prefix_and_runs_from_its_first_token():
    """The decode role: only blocks past the cached prefix are filled; once they arrive the sequence
    decodes its first token, ahead of waiting sequences."""
    sched = make_scheduler(max_num_seqs=1)
    cached = make_seq(8, max_new=1)
    sched.add(cached)
    step(sched)
    sched.finish(cached, "length")  # its two full blocks stay cached
    seq = make_seq(10)
    seq.output_token_ids.append(99)  # the first token, from the prefill server
    first_block = sched.reserve_prefilled(seq)
    assert first_block == 2 and len(seq.block_ids) == 3 and seq.status is SequenceStatus.RECEIVING
    assert not sched.has_work  # nothing to schedule while its K/V is on its way
    sched.end_transfer(seq, ok=True)
    waiting = make_seq(4, first_token=50)
    sched.add(waiting)
    assert segments(step(sched)) == {seq.seq_id: 1}  # its first token, in the one slot
    assert seq.num_computed_tokens == 11 and waiting.status is SequenceStatus.WAITING


def test_a_receiving_sequence_that_ends_frees_its_blocks_only_once_the_transfer_has():
    sched = make_scheduler()
    seq = make_seq(10)
    seq.output_token_ids.append(99)
    sched.reserve_prefilled(seq)
    used = sched.block_manager.num_used_blocks
    sched.abort(seq)
    assert sched.block_manager.num_used_blocks == used  # the transfer may still write them
    sched.end_transfer(seq, ok=True)
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work
    sched.check_invariants()


def test_a_failed_transfer_leaves_the_sequence_to_be_computed_here():
    sched = make_scheduler()
    seq = make_seq(10)
    seq.output_token_ids.append(99)
    sched.reserve_prefilled(seq)
    sched.end_transfer(seq, ok=False)
    assert seq.status is SequenceStatus.WAITING and not seq.block_ids
    assert segments(step(sched))[seq.seq_id] == 11  # the prompt and its first token


def test_a_prompt_the_pool_cannot_hold_reserves_nothing():
    sched = make_scheduler(num_blocks=2)
    seq = make_seq(10)
    seq.output_token_ids.append(99)
    assert sched.reserve_prefilled(seq) is None
    assert seq.status is SequenceStatus.WAITING and sched.block_manager.num_used_blocks == 0
