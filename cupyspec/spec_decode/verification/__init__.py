"""Verification of drafts against the target model, with the logprobs of the verified rows."""
