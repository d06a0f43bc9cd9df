"""tools/draft_vocab.py: which tokens a head's draft vocabulary holds, and the head file it writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from draft_vocab import main, most_frequent, token_counts
from safetensors import safe_open
from safetensors.numpy import load_file
from tiny_models import TinySpec, random_head_weights, tiny_model_paths, write_head_file

from cupyspec.loader import load_model
from cupyspec.model.mtp import DRAFT_VOCAB, load_head_weights


def test_the_most_frequent_tokens_are_kept_with_the_end_tokens_ties_to_the_lowest_id():
    counts = np.array([5, 9, 1, 9, 0, 3])  # [V]
    np.testing.assert_array_equal(most_frequent(counts, 3, always=(4,)), [1, 3, 4])
    np.testing.assert_array_equal(most_frequent(counts, 2, always=()), [1, 3])
    np.testing.assert_array_equal(most_frequent(counts, 4, always=(1,)), [0, 1, 3, 5])
    with pytest.raises(ValueError, match="size"):
        most_frequent(counts, 7, always=())


def test_tokens_are_counted_in_the_rendered_chat(tmp_path):
    tokenizer = load_model(str(tiny_model_paths(tmp_path, "llama")[1])).tokenizer
    counts = token_counts(tokenizer, tokenizer.vocab_size, [("hello there", "general kenobi")])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"},
                                          {"role": "assistant", "content": "general kenobi"}],
                                         add_generation_prompt=False)
    np.testing.assert_array_equal(counts, np.bincount(tokenizer.encode(text), minlength=tokenizer.vocab_size))


def test_the_head_file_gains_a_vocabulary_the_engine_loads(tmp_path):
    gguf = tiny_model_paths(tmp_path, "llama")[1]
    head = write_head_file(tmp_path / "head.safetensors", random_head_weights(TinySpec()))
    prompt, answer = "Tell me about rivers and the sea " * 3, "Rivers run to the sea, mostly. " * 4
    conversations = [{"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]}] * 40
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations))
    out = tmp_path / "vocab.safetensors"
    main(["--head", str(head), "--out", str(out), "--model", str(gguf), "--dataset-path", str(dataset),
          "--held-out-prompts", "10", "--num-prompts", "30", "--size", "20"])
    loaded = load_model(str(gguf))
    vocab = load_head_weights(out, loaded.config)[DRAFT_VOCAB]
    assert len(vocab) == 20 and set(loaded.tokenizer.eos_token_ids) <= set(vocab.tolist())
    counts = token_counts(loaded.tokenizer, loaded.config.vocab_size, [(prompt, answer)])
    np.testing.assert_array_equal(vocab, most_frequent(counts, 20, loaded.tokenizer.eos_token_ids))
    original = load_file(str(head))
    assert all(np.array_equal(load_file(str(out))[name], w) for name, w in original.items())
    with safe_open(str(out), framework="numpy") as file:
        assert file.metadata()["format"] == "cupyspec-mtp-v1"
