"""Text in and out: the tokenizer, incremental detokenization, and token strings for logprobs."""
