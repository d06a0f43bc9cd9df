"""Speculative decoding: the speculative config, draft proposers, verification, and the back-off rule."""
