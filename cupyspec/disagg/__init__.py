"""Prefill/decode disaggregation: KV blocks moved between the pools of separate engines."""
