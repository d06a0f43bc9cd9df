"""The proposer that a speculative config asks for."""

from __future__ import annotations

from cupyspec.spec_decode.proposers.base import NaiveProposer, Proposer
from cupyspec.spec_decode.proposers.hybrid import MTPWithNgram
from cupyspec.spec_decode.proposers.mtp import MTPProposer
from cupyspec.spec_decode.proposers.ngram import NgramProposer
from cupyspec.spec_decode.proposers.suffix import SuffixProposer
from cupyspec.spec_decode.speculative_config import SpeculativeConfig


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """A proposer for `config.method`; None when speculation is off."""
    method = config.method
    if method is None:
        return None
    if method == "naive":
        return NaiveProposer()
    if method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if method == "suffix":
        return SuffixProposer(
            max_tree_depth=config.suffix_decoding_max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
            max_spec_factor=config.suffix_decoding_max_spec_factor,
            min_token_prob=config.suffix_decoding_min_token_prob,
        )
    if method == "mtp":
        if config.mtp_strategy == "with_ngram":
            ngram = NgramProposer(config.ngram_min, config.ngram_max)
            return MTPWithNgram(MTPProposer(), ngram, config.num_model_steps)
        return MTPProposer()
    raise ValueError(f"unknown speculative method {method!r}")


def mtp_proposer(proposer: Proposer | None) -> MTPProposer | None:
    """The MTP head's proposer inside `proposer` (itself, or a hybrid's), or None."""
    if isinstance(proposer, MTPWithNgram):
        return proposer.first
    return proposer if isinstance(proposer, MTPProposer) else None
