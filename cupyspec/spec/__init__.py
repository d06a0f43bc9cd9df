"""Speculative decoding: draft proposers, verification and acceptance bookkeeping."""
