"""Batched verification of draft tokens against the target model, for NumPy and CuPy alike.

Request b brings num_drafts[b] drafts and num_drafts[b] + 1 target rows: row j scores the token
after draft j - 1 (row 0 the token after the last emitted one). The target distribution p_j at a
row is the one plain sampling would use there (penalties over the output including the earlier
drafts, temperature, top-k, top-p, min-p; one-hot at the argmax when greedy). Strategies:

- `rejection` (lossless speculative sampling): accept d_j when u' * q_j(d_j) < p_j(d_j), i.e. with
  probability min(1, p/q), q the draft distribution (one-hot at d_j without draft_probs); at the
  first rejection emit a draw from max(0, p_j - q_j) normalized, else the bonus token from p.
- `greedy`: accept d_j when it is the argmax of the penalized logits.
- `target_match` (lossless): accept d_j when it equals the token sampled from p_j.
- `topp`: accept d_j when p_j(d_j) > 0, i.e. when it lies in the row's top-p set (the smallest
  set of most likely tokens reaching top_p, within top-k and min-p); with top_p = 1 that is every
  token of nonzero probability. Lossy, as in FastDeploy, whose kernel also caps the set at a fixed
  number of candidates and accepts a run of argmax matches after a second-ranked draft
  (`verify_window`); both refinements are left out here.

Every other emitted token (bonus tokens; corrections of the other strategies) is the row's plain
sample: inverse CDF with the row's uniform, the argmax when greedy. Accept policies: `normal`;
`accept_all` takes every draft and then the bonus token; `reject_all` takes none and emits
exactly what non-speculative decoding would. Everything runs batched on the device; the host
receives accept counts and emitted tokens in one transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.model.device_tokens import DeviceTokens
from cupyspec.sampling.argmax import argmax_rows
from cupyspec.sampling.sampler import SamplingRow, drawn_rows, penalized_logits
from cupyspec.spec_decode.speculative_config import ACCEPT_POLICIES, VERIFY_STRATEGIES
from cupyspec.spec_decode.verification.accept_runs import accept_runs, greedy_runs
from cupyspec.spec_decode.verification.target_probs import DraftLayout, TargetRows, draft_scores, score_rows
from cupyspec.transfer import fetch_arrays, to_device

PLACEHOLDER_TOKEN_ID = -1  # fills the fixed-shape output past each request's emitted tokens


@dataclass(frozen=True)
class VerifyInput:
    """Drafts of B requests (at most K each) and the sampling inputs of their target rows."""

    draft_token_ids: np.ndarray  # [B, K] int64 host, PLACEHOLDER_TOKEN_ID past num_drafts[b]
    num_drafts: np.ndarray  # [B] int64 host, 0..K
    draft_probs: Any | None  # [B, K, V] f32 on the device, or None: one-hot drafts (ngram, suffix)
    rows: tuple[SamplingRow, ...]  # [R = sum(num_drafts + 1)]; each row's output ids include the drafts before it
    extra_uniforms: np.ndarray  # [R] float64 host: the draws of the acceptance tests (`rejection`)
    draft_logprobs: np.ndarray | None = None  # [B, K] f32 host: the draft model's logprob of each draft (NaN: none)
    # where the next step reads this one's emitted tokens and accepted drafts, and where the drafts
    # that draft_token_ids names by placeholders (~slot) are: an MTP head's, still on the device
    # (greedy rows only: the other strategies read the drafts on the host)
    device_tokens: DeviceTokens | None = None

    def __post_init__(self) -> None:
        drafts = np.asarray(self.draft_token_ids)
        num = np.asarray(self.num_drafts)
        if drafts.ndim != 2 or drafts.dtype.kind not in "iu":
            raise ValueError(f"draft_token_ids must be a 2-D integer array [B, K], got {drafts.dtype} {drafts.shape}")
        if num.shape != (drafts.shape[0],) or num.dtype.kind not in "iu":
            raise ValueError(f"num_drafts must be an integer array of shape [B={drafts.shape[0]}], got {num.shape}")
        if num.size and (num.min() < 0 or num.max() > drafts.shape[1]):
            raise ValueError(f"num_drafts must lie in [0, K={drafts.shape[1]}]")
        num_rows = int(num.sum()) + len(num)
        if len(self.rows) != num_rows:
            raise ValueError(f"rows must hold sum(num_drafts + 1) = {num_rows} rows, got {len(self.rows)}")
        uniforms = np.asarray(self.extra_uniforms, dtype=np.float64)
        if uniforms.shape != (num_rows,):
            raise ValueError(f"extra_uniforms must have shape [{num_rows}], got {uniforms.shape}")
        if uniforms.size and not (uniforms.min() >= 0.0 and uniforms.max() < 1.0):
            raise ValueError("extra_uniforms must lie in [0, 1)")
        if self.draft_logprobs is not None and np.shape(self.draft_logprobs) != drafts.shape:
            raise ValueError(f"draft_logprobs must have shape {drafts.shape}, got {np.shape(self.draft_logprobs)}")
        object.__setattr__(self, "draft_token_ids", drafts.astype(np.int64, copy=False))
        object.__setattr__(self, "num_drafts", num.astype(np.int64, copy=False))
        object.__setattr__(self, "extra_uniforms", uniforms)


@dataclass(frozen=True)
class VerifyOutput:
    """Host results of one verification step."""

    output_token_ids: np.ndarray  # [B, K+1] int64: accepted drafts, then the bonus/correction token; PLACEHOLDER after
    accept_num: np.ndarray  # [B] int64: emitted tokens = accepted drafts + 1
    num_accepted_drafts: np.ndarray  # [B] int64
    accepted_mask: np.ndarray  # [B, K] bool: draft j accepted

    @classmethod
    def of(cls, inp: VerifyInput, num_accepted: np.ndarray, emitted: np.ndarray) -> VerifyOutput:
        """Host output arrays from the accepted draft counts [B] and the emitted last tokens [B]."""
        batch, k = inp.draft_token_ids.shape
        accepted = np.arange(k)[None, :] < num_accepted[:, None]  # [B, K]
        out = np.full((batch, k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        out[:, :k] = np.where(accepted, inp.draft_token_ids, PLACEHOLDER_TOKEN_ID)
        out[np.arange(batch), num_accepted] = emitted
        return cls(out, num_accepted + 1, num_accepted, accepted)


@dataclass(frozen=True)
class DeviceVerdict:
    """Verification results still on the device, for consumers that fuse more work before the transfer."""

    runs: Any  # [2, B] int64: drafts before the first rejection, then the bonus or correction token after them
    # [2B + B*K] int64: the runs, then the drafts [B, K] with their placeholders resolved, when some were
    # placeholders (one array, for one transfer)
    runs_and_drafts: Any | None = None

    @property
    def num_accepted(self) -> Any:  # [B] int64
        return self.runs[0]

    @property
    def emitted(self) -> Any:  # [B] int64
        return self.runs[1]

    def to_host(self, xp: Any, inp: VerifyInput) -> VerifyOutput:
        num_accepted, emitted = fetch_arrays(xp, [self.runs])[0]
        return VerifyOutput.of(inp, num_accepted, emitted)


def draft_distributions(xp: Any, draft_token_ids: np.ndarray, num_drafts: np.ndarray, probs: Sequence[Any | None],
                        vocab: int) -> Any | None:
    """VerifyInput.draft_probs [B, K, V] f32 on xp's device from each request's q [k, V] (None: its
    drafts are one-hot); None when no request has any."""
    if all(p is None for p in probs):
        return None
    batch, k = draft_token_ids.shape
    out = xp.zeros((batch, k, vocab), dtype=np.float32)
    one_hot = np.array([p is None for p in probs]) & (num_drafts > 0)  # [B]
    request = np.repeat(np.arange(batch), np.where(one_hot, num_drafts, 0))  # [D1]
    position = np.concatenate([np.arange(n) for n in num_drafts[one_hot]] or [np.zeros(0, np.int64)])  # [D1]
    if request.size:
        out[to_device(xp, request), to_device(xp, position), to_device(xp, draft_token_ids[request, position])] = 1.0
    for b, p in enumerate(probs):
        if p is not None:
            out[b, :len(p)] = p
    return out


def _accepted(xp: Any, strategy: str, target: TargetRows, layout: DraftLayout,
              inp: VerifyInput) -> tuple[Any, Any | None]:
    """Each draft's own test (accepted [D] bool) and, for `rejection`, the residual picks [D] int64."""
    draft = to_device(xp, layout.tokens)  # [D]
    rows = to_device(xp, layout.rows)  # [D]
    if strategy == "greedy":
        return argmax_rows(xp, target.logits[rows]) == draft, None
    if strategy == "target_match":
        return target.tokens[rows] == draft, None
    p_draft, residual_pick = draft_scores(xp, target, layout, inp.draft_probs, inp.rows, strategy == "rejection")
    if strategy == "topp":
        return p_draft > 0, None
    if inp.draft_probs is None:
        q_draft = 1.0
    else:
        request, position = to_device(xp, layout.request), to_device(xp, layout.position)  # [D] each
        q_draft = inp.draft_probs[request, position, draft].astype(xp.float64)
    u = to_device(xp, inp.extra_uniforms[layout.rows])  # [D]
    return u * q_draft < p_draft, residual_pick


def verify_on_device(xp: Any, target_logits: Any, inp: VerifyInput, strategy: str = "rejection",
                     accept_policy: str = "normal") -> DeviceVerdict:
    """Accept drafts and pick each request's bonus or correction token, without a host transfer.

    target_logits [R, V] f32 on the device.
    """
    if strategy not in VERIFY_STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(VERIFY_STRATEGIES)}, not {strategy!r}")
    if accept_policy not in ACCEPT_POLICIES:
        raise ValueError(f"accept_policy must be one of {', '.join(ACCEPT_POLICIES)}, not {accept_policy!r}")
    batch, k = inp.draft_token_ids.shape
    num_rows = len(inp.rows)
    if target_logits.ndim != 2 or target_logits.shape[0] != num_rows:
        raise ValueError(f"target_logits must have shape [R={num_rows}, V], got {target_logits.shape}")
    vocab = target_logits.shape[1]
    drafts = inp.draft_token_ids[np.arange(k) < inp.num_drafts[:, None]]  # [D]
    if drafts.size and ((inp.device_tokens is None and drafts.min() < 0) or drafts.max() >= vocab):
        raise ValueError(f"draft_token_ids holds a draft outside the vocabulary [0, {vocab})")
    if inp.draft_probs is not None and tuple(inp.draft_probs.shape) != (batch, k, vocab):
        raise ValueError(f"draft_probs must have shape [B={batch}, K={k}, V={vocab}], got {inp.draft_probs.shape}")
    if batch == 0:
        return DeviceVerdict(xp.zeros((2, 0), xp.int64))

    logits = target_logits.astype(xp.float32, copy=False)
    if drafts.size and not drawn_rows(inp.rows).size:
        # no row draws: under every strategy a draft passes iff it is its row's argmax
        packed = greedy_runs(xp, penalized_logits(xp, logits, inp.rows), inp.draft_token_ids, inp.num_drafts,
                             inp.device_tokens, accept_policy)  # [2B + B*K]
        runs = packed[:2 * batch].reshape(2, batch)
        return DeviceVerdict(runs, packed if drafts.min() < 0 else None)
    if drafts.size and drafts.min() < 0:
        raise ValueError("drafts still on the device verify on greedy rows only")
    verdict = _verify_on_host_drafts(xp, logits, inp, strategy, accept_policy)
    if inp.device_tokens is not None:
        inp.device_tokens.put_verdict(verdict.runs)
    return verdict


def _verify_on_host_drafts(xp: Any, logits: Any, inp: VerifyInput, strategy: str,
                           accept_policy: str) -> DeviceVerdict:
    """verify_on_device's work past the greedy case, with every draft on the host."""
    batch, num_rows = len(inp.num_drafts), len(inp.rows)
    first_row = np.concatenate([[0], np.cumsum(inp.num_drafts + 1)])  # [B+1] bounds of each request's rows
    layout = DraftLayout.of(inp.draft_token_ids, inp.num_drafts)
    target = score_rows(xp, logits, inp.rows, layout)
    if accept_policy != "normal" or not layout.rows.size:
        num_accepted = inp.num_drafts if accept_policy == "accept_all" else np.zeros(batch, np.int64)
        emitted = target.tokens[to_device(xp, first_row[:-1] + num_accepted)]  # [B]
        return DeviceVerdict(xp.stack([to_device(xp, num_accepted), emitted.astype(xp.int64)]))

    accepted, residual_pick = _accepted(xp, strategy, target, layout, inp)  # [D], [D] or None
    passed = xp.zeros(num_rows, dtype=bool)  # [R]
    passed[to_device(xp, layout.rows)] = accepted
    emit_at = target.tokens  # [R] token emitted when the request stops at that row
    if residual_pick is not None:
        emit_at = emit_at.copy()
        emit_at[to_device(xp, layout.rows)] = residual_pick
    return DeviceVerdict(accept_runs(xp, passed, emit_at, to_device(xp, first_row)))


def verify(xp: Any, target_logits: Any, inp: VerifyInput, strategy: str = "rejection",
           accept_policy: str = "normal") -> VerifyOutput:
    """verify_on_device, then one transfer of its results to the host."""
    return verify_on_device(xp, target_logits, inp, strategy, accept_policy).to_host(xp, inp)
