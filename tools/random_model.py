"""Write a GGUF file of a known model's shape with random fp16 weights: for measurements that do not
depend on the weights' values, such as tensor parallelism on a model worth sharding (correctness
is checked against one GPU on the same file).

The tokenizer, and so the vocabulary, comes from another GGUF file: the default model's unless
`--tokenizer-from` names one. SmolLM2-1.7B shares the default model's tokenizer; the Qwen2.5-1.5B
shape then has its layers (and Q/K/V biases) with SmolLM2's 49,152-token vocabulary.

    PYTHONPATH=. python tools/random_model.py --like smollm2-1.7b --out smollm2-1.7b-random.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from cupyspec.loader import DEFAULT_MODEL, resolve_model


@dataclass(frozen=True)
class Shape:
    """A decoder's hyper-parameters, as its HF config.json gives them."""

    architecture: str  # "llama" | "qwen2" (qwen2: biases on Q/K/V)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    tied: bool  # the LM head is the embedding


SHAPES = {
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 8192, 130000.0, 1e-5, 8192, True),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 1000000.0, 1e-6, 32768, True),
}


def random_tensors(shape: Shape, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """GGUF-named tensors ([out, in] numpy order): matrices N(0, 1 / in) in fp16, norms 1, biases 0."""
    rng = np.random.default_rng(seed)
    d = shape.hidden // shape.heads
    q, kv = shape.heads * d, shape.kv_heads * d

    def matrix(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp), dtype=np.float32) / np.sqrt(inp)).astype(np.float16)

    ones = np.ones(shape.hidden, np.float32)  # [H]: every norm's weight
    tensors = {"token_embd.weight": matrix(vocab, shape.hidden), "output_norm.weight": ones}
    if not shape.tied:
        tensors["output.weight"] = matrix(vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"blk.{i}."
        tensors |= {p + "attn_norm.weight": ones,
                    p + "attn_q.weight": matrix(q, shape.hidden), p + "attn_k.weight": matrix(kv, shape.hidden),
                    p + "attn_v.weight": matrix(kv, shape.hidden), p + "attn_output.weight": matrix(shape.hidden, q),
                    p + "ffn_norm.weight": ones,
                    p + "ffn_gate.weight": matrix(shape.ffn, shape.hidden),
                    p + "ffn_up.weight": matrix(shape.ffn, shape.hidden),
                    p + "ffn_down.weight": matrix(shape.hidden, shape.ffn)}
        if shape.architecture == "qwen2":
            widths = {"q": q, "k": kv, "v": kv}
            tensors |= {p + f"attn_{n}.bias": np.zeros(width, np.float32) for n, width in widths.items()}
    return tensors


def write_random_model(path: Path, shape: Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """The GGUF file of `shape` with random weights and `tokenizer_from`'s tokenizer at `path`."""
    source = gguf.GGUFReader(str(tokenizer_from))
    tokenizer_keys = {name: field for name, field in source.fields.items() if name.startswith("tokenizer.")}
    vocab = len(tokenizer_keys["tokenizer.ggml.tokens"].contents())
    writer = gguf.GGUFWriter(str(path), shape.architecture)
    writer.add_name(f"random {shape.architecture} {shape.layers}x{shape.hidden}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.max_positions)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    for name, field in tokenizer_keys.items():
        kind = field.types[0]
        sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for name, tensor in random_tensors(shape, vocab, seed).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--like", choices=sorted(SHAPES), required=True, help="the shape to write")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path, help="a GGUF file (default: the default model's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write_random_model(args.out, SHAPES[args.like], args.tokenizer_from or resolve_model(DEFAULT_MODEL),
                              args.seed)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
