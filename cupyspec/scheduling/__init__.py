"""Continuous batching: sequences, the scheduler that picks each step's tokens, and the KV block accounting."""
