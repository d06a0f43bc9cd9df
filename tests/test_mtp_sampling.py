"""MTP drafts under sampling: a sequence that samples draws its drafts from the head's distribution q
(its own temperature, top-k, top-p and min-p) with the draw of each draft's position, and q goes to
`rejection` verification with the draft. Checked with the drafting sampler and the verifier the
engine runs, then through the engine."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from test_mtp_engine import make_engine, run, with_draft_vocab
from test_verify import TRIALS, VOCAB, chi_square_passes, reference_probs

from cupyspec.sampling.params import SamplingParams
from cupyspec.sampling.sampler import SamplingRow
from cupyspec.sampling.uniforms import ACCEPT_STREAM, SAMPLE_STREAM, counter_uniforms
from cupyspec.spec_decode.proposers.mtp import DraftSampling, draw_drafts
from cupyspec.spec_decode.verification.verify import VerifyInput, draft_distributions, verify

TARGET = SamplingParams(temperature=1.0, top_p=0.8, top_k=5)
TARGET_LOGITS = np.array([1.2, 0.9, 0.5, 0.1, -0.4, -1.0], dtype=np.float32)  # [V]: p of the verified row


def draft_and_verify(head_logits: np.ndarray, with_q: bool, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One draft per sequence drawn from q (the head's logits [V] under TARGET) by the engine's
    drafting sampler, verified by `rejection` against TARGET_LOGITS; q passed to the verifier, or
    left out (one-hot drafts). Returns the emitted tokens [N] and whether each draft was accepted."""
    n = len(keys)
    logits = np.tile(head_logits, (n, 1)).astype(np.float32)  # [N, V]
    positions = np.full(n, 7, dtype=np.int64)  # the draft's position: every sequence's seventh token
    picks, model_logprobs = np.zeros(n, np.int64), np.zeros(n, np.float32)
    q = draw_drafts(np, logits, positions, DraftSampling(np.arange(n), (TARGET,) * n, keys), picks, model_logprobs)
    drafts, num_drafts = picks[:, None], np.ones(n, np.int64)
    draft_probs = draft_distributions(np, drafts, num_drafts, list(q[:, None]) if with_q else [None] * n, VOCAB)
    rows_positions = np.repeat(positions, 2) + np.tile([0, 1], n)  # the draft's row, then the bonus row
    uniforms = counter_uniforms(np.repeat(keys, 2), rows_positions, SAMPLE_STREAM)
    rows = tuple(SamplingRow(TARGET, float(u)) for u in uniforms)
    inp = VerifyInput(drafts, num_drafts, draft_probs, rows,
                      counter_uniforms(np.repeat(keys, 2), rows_positions, ACCEPT_STREAM))
    out = verify(np, np.tile(TARGET_LOGITS, (2 * n, 1)), inp, "rejection")
    return out.output_token_ids[:, 0], out.num_accepted_drafts == 1


@pytest.mark.parametrize("offset", [0.0, 1.5], ids=["q near p", "q far from p"])
def test_drafts_drawn_from_q_verify_to_the_target_distribution(offset: float) -> None:
    head = TARGET_LOGITS[::-1] * 0.5 + offset * np.arange(VOCAB)[::-1]  # q overlapping p, less or more
    keys = np.random.default_rng(3).integers(0, 2**63, TRIALS).astype(np.uint64)
    p = reference_probs(TARGET_LOGITS[None], TARGET)[0]
    with_q, accepted_q = draft_and_verify(head, True, keys)
    one_hot, accepted_one_hot = draft_and_verify(head, False, keys)
    assert chi_square_passes(with_q, p)
    # one-hot verification of drafts drawn from q is lossless too (accept with p(d), else draw from
    # p without d), but accepts less: min(1, p/q) >= p
    assert chi_square_passes(one_hot, p)
    assert accepted_q.mean() > accepted_one_hot.mean() + 0.05


def test_a_verifier_that_corrects_without_q_is_caught() -> None:
    """Accepting with min(1, p/q) but correcting from p - onehot(d) (q left out of the residual) is
    biased: the statistical test above has the power to tell."""
    head = TARGET_LOGITS[::-1] * 0.5
    keys = np.random.default_rng(4).integers(0, 2**63, TRIALS).astype(np.uint64)
    p = reference_probs(TARGET_LOGITS[None], TARGET)[0]
    n = len(keys)
    picks, lps = np.zeros(n, np.int64), np.zeros(n, np.float32)
    sampling = DraftSampling(np.arange(n), (TARGET,) * n, keys)
    q = draw_drafts(np, np.tile(head, (n, 1)).astype(np.float32), np.full(n, 7), sampling, picks, lps)
    u_accept = counter_uniforms(keys, np.full(n, 7), ACCEPT_STREAM)
    accepted = u_accept * q[np.arange(n), picks] < p[picks]
    residual = np.tile(p, (n, 1))
    residual[np.arange(n), picks] = 0.0  # as if q were one-hot at the draft
    residual /= residual.sum(axis=1, keepdims=True)
    u_sample = counter_uniforms(keys, np.full(n, 7), SAMPLE_STREAM)
    corrections = (np.cumsum(residual, axis=1) <= u_sample[:, None]).sum(axis=1)
    assert not chi_square_passes(np.where(accepted, picks, corrections), p)


def test_drafts_are_drawn_from_their_own_distribution() -> None:
    """The drafting sampler's picks follow q, which is the head's softmax under the parameters, and
    their head logprobs are the raw log-softmax of the head's logits."""
    head = np.array([0.3, 2.0, -1.0, 1.0, 0.0, 0.5], dtype=np.float32)
    n = TRIALS
    keys = np.random.default_rng(5).integers(0, 2**63, n).astype(np.uint64)
    picks, lps = np.zeros(n, np.int64), np.zeros(n, np.float32)
    sampling = DraftSampling(np.arange(n), (TARGET,) * n, keys)
    q = draw_drafts(np, np.tile(head, (n, 1)), np.arange(n), sampling, picks, lps)
    want = reference_probs(head[None], TARGET)[0]
    np.testing.assert_allclose(q, np.tile(want, (n, 1)), atol=1e-6)
    assert chi_square_passes(picks, want)
    log_softmax = head - np.log(np.exp(head.astype(np.float64)).sum())
    np.testing.assert_allclose(lps, log_softmax[picks], rtol=1e-5)


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def tiny(tiny_mtp) -> tuple[str, str]:
    return tiny_mtp


SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True)
PROMPTS = [[7, 8, 9, 10, 11, 12] * 3, [3, 4, 5] * 5, list(range(20, 40))]


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_sampled_requests_verify_their_drafts_with_q(tiny, tmp_path, monkeypatch, draft_vocab) -> None:
    """Each verified draft of a sampled request comes with q [V], a distribution under which the draft
    has positive probability, and its head logprob; a greedy request's drafts are one-hot. With a
    draft vocabulary, every draft is one of its tokens and q is 0 elsewhere."""
    import cupyspec.engine.runner as runner_module

    model, head = tiny
    vocab = None
    if draft_vocab:
        head, vocab = with_draft_vocab(head, tmp_path)
    seen: list[VerifyInput] = []
    original = runner_module.launch_verify

    def spy(xp, logits, inp, *args, **kwargs):
        seen.append(inp)
        return original(xp, logits, inp, *args, **kwargs)

    monkeypatch.setattr(runner_module, "launch_verify", spy)

    async def main():
        engine = await make_engine(model, method="mtp", model=head, num_model_steps=2, num_speculative_tokens=2)
        await asyncio.gather(run(engine, PROMPTS[0], dataclasses.replace(SAMPLED, seed=1)),
                             run(engine, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)))
        await engine.shutdown()

    asyncio.run(main())
    checked = 0
    for inp in seen:
        if inp.draft_probs is None:  # only greedy requests in the step: every draft one-hot
            continue
        for b, (drafts, n) in enumerate(zip(inp.draft_token_ids, inp.num_drafts)):
            q = inp.draft_probs[b, np.arange(n), drafts[:n]]
            np.testing.assert_allclose(inp.draft_probs[b, :n].sum(axis=1), 1.0, rtol=1e-5)
            assert (q > 0).all() and np.isfinite(inp.draft_logprobs[b, :n]).all()
            if vocab is not None:
                assert np.isin(drafts[:n], vocab).all()
                assert not np.delete(inp.draft_probs[b, :n], vocab, axis=1).any()
            greedy = inp.rows[int((inp.num_drafts[:b] + 1).sum())].params.greedy
            if greedy:
                assert (q == 1.0).all()
            checked += int(n)
    assert checked > 10


def test_a_seeded_sampled_request_is_reproducible_and_batch_independent(tiny) -> None:
    """Drafts drawn with the counter-based draw of their position: a seeded request gets the same
    tokens alone and beside others, and another seed gets other tokens."""
    model, head = tiny

    async def main():
        engine = await make_engine(model, method="mtp", model=head, num_model_steps=3, num_speculative_tokens=3)
        alone = await run(engine, PROMPTS[0], dataclasses.replace(SAMPLED, seed=7))
        others = (run(engine, p, dataclasses.replace(SAMPLED, seed=i)) for i, p in enumerate(PROMPTS))
        crowd = await asyncio.gather(run(engine, PROMPTS[0], dataclasses.replace(SAMPLED, seed=7)), *others)
        other = await run(engine, PROMPTS[0], dataclasses.replace(SAMPLED, seed=8))
        stats = engine.stats()
        await engine.shutdown()
        return alone, crowd[0], other, stats

    alone, beside, other, stats = asyncio.run(main())
    assert alone["tokens"] == beside["tokens"] and len(alone["tokens"]) == SAMPLED.max_tokens
    assert other["tokens"] != alone["tokens"]
    assert alone["spec"].num_draft_tokens > 0
    assert stats.num_used_kv_blocks == 0
