"""Prompt lookup decoding: draft what followed an earlier occurrence of the context's last n tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cupyspec.spec_decode.proposers.base import NO_DRAFTS, DraftRequest, Drafts, Proposer, unseen_tokens


class _History:
    """One sequence's tokens, with where each token and each pair of tokens ends (appended to as it grows)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.by_token: dict[int, list[int]] = {}  # token -> ascending positions holding it
        self.by_pair: dict[tuple[int, int], list[int]] = {}  # (token, next) -> ascending positions of next

    def extend(self, new: list[int]) -> None:
        tokens, by_token, by_pair = self.tokens, self.by_token, self.by_pair
        for token in new:
            position = len(tokens)
            by_token.setdefault(token, []).append(position)
            if position:
                by_pair.setdefault((tokens[-1], token), []).append(position)
            tokens.append(token)


class NgramProposer(Proposer):
    """N-gram matching over each sequence's own prompt + output.

    For n from `ngram_max` down to `ngram_min`, the last n tokens are looked up among the earlier
    positions; the first n that occurs decides the match. Among that n-gram's occurrences the
    proposer takes the one whose preceding tokens agree with the context the longest (compared up
    to `agreement_window` tokens back), and among equally long agreements the most recent one.
    The earliest occurrence (vLLM's and classic prompt lookup's choice) suits an output that copies
    an edited prompt, the most recent one text that repeats itself; ranking by agreement suits both.

    Drafts are the tokens that followed the occurrence. Where they run into the current end of the
    context (a periodic tail), they continue periodically, since the occurrence's continuation then
    repeats the context's own tail.

    Each sequence keeps an index of where every token and every pair of tokens occurs, extended by
    the tokens added since its last proposal, so a proposal compares only the occurrences of the
    context's last pair (or, when the pair never occurred before, takes the last token's most
    recent occurrence) instead of scanning the whole context.
    """

    method = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4, agreement_window: int = 64) -> None:
        if not (isinstance(ngram_min, int) and isinstance(ngram_max, int) and 1 <= ngram_min <= ngram_max):
            raise ValueError(f"ngram_min and ngram_max need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if not isinstance(agreement_window, int) or agreement_window < ngram_max:
            raise ValueError(f"agreement_window must be an integer >= ngram_max, got {agreement_window}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.agreement_window = agreement_window
        self._histories: dict[int, _History] = {}  # seq_id -> its indexed tokens

    def propose(self, requests: Sequence[DraftRequest]) -> list[Drafts]:
        return self.propose_copies(requests, self.ngram_min)

    def propose_copies(self, requests: Sequence[DraftRequest], min_agreement: int) -> list[Drafts]:
        """`propose`, where the occurrence agrees with the context on at least `min_agreement` tokens
        (>= ngram_min); none elsewhere."""
        out = [NO_DRAFTS] * len(requests)
        for i, r in enumerate(requests):
            if r.max_drafts > 0 and r.token_ids.size > self.ngram_min:
                drafts = self._drafts(self._history(r), r.max_drafts, min_agreement)
                if drafts:
                    out[i] = Drafts(np.array(drafts, dtype=np.int32))
        return out

    def on_sequence_finished(self, seq_id: int, request_id: str, token_ids: np.ndarray, num_prompt_tokens: int) -> None:
        self._histories.pop(seq_id, None)

    def _history(self, r: DraftRequest) -> _History:
        """The sequence's index, extended to r.token_ids (rebuilt when they are not a continuation)."""
        history = self._histories.get(r.seq_id) or _History()
        new = unseen_tokens(history.tokens, r.token_ids)
        if new is None:
            history, new = _History(), r.token_ids.tolist()
        self._histories[r.seq_id] = history
        history.extend(new)
        return history

    def _drafts(self, history: _History, max_drafts: int, min_agreement: int) -> list[int]:
        """What followed the best occurrence of the context's tail (see the class docstring)."""
        tokens, end, window = history.tokens, len(history.tokens) - 1, self.agreement_window
        best, best_agreement = -1, 0
        if window >= 2:  # occurrences of the last pair agree on 2 tokens at least; any of them beats the others
            for candidate in reversed(history.by_pair.get((tokens[end - 1], tokens[end]), ())):
                if candidate == end:
                    continue
                agreement = 2  # most recent first: a later candidate must agree strictly longer
                while (agreement < window and candidate - agreement >= 0
                       and tokens[candidate - agreement] == tokens[end - agreement]):
                    agreement += 1
                if agreement > best_agreement:
                    best, best_agreement = candidate, agreement
                    if agreement == window:
                        break
        if best < 0:  # no earlier pair: the last token's most recent earlier occurrence agrees on 1
            positions = history.by_token[tokens[end]]
            if len(positions) > 1:
                best, best_agreement = positions[-2], 1
        if best_agreement < max(self.ngram_min, min_agreement):
            return []
        period = end - best  # tokens after the occurrence up to the context's end
        return [tokens[best + 1 + i % period] for i in range(max_drafts)]
