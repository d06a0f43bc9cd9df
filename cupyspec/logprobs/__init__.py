"""Logprobs of target and draft tokens: log-softmax and top-k, the layout of a step's rows, the gather of
accepted rows, chat JSON rendered on the device, and CUDA graphs of all of it."""
