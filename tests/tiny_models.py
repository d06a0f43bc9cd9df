"""Tiny random llama/qwen2 models written as HF directories and as GGUF files, for CPU tests."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_ID, EOS_ID = 0, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Speculative decoding drafts a few tokens and the target model verifies them in one pass.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, 2))\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 and 12345 items.",
    "Hello world! Hello there, how are you? I'm fine, thanks. We'll see what they've done.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n",
]


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: specials <|endoftext|> (0), <|im_start|> (1), <|im_end|> (2), 256 bytes, merges."""
    return Tokenizer.from_str(_tokenizer_json())


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model; the vocabulary is the tiny tokenizer's."""

    arch: str = "llama"  # "llama" | "qwen2"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5
    max_positions: int = 512
    tied: bool = False

    @property
    def vocab(self) -> int:
        return tiny_tokenizer().get_vocab_size(with_added_tokens=True)

    @property
    def bias(self) -> bool:
        return self.arch == "qwen2"


def random_weights(spec: TinySpec, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights; scaled so that activations and logits stay O(1)."""
    rng = np.random.default_rng(seed)

    def linear(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(spec.hidden)).astype(np.float32)

    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    w = {"model.embed_tokens.weight": (0.5 * rng.standard_normal((spec.vocab, spec.hidden))).astype(np.float32)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = linear(q, spec.hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv, spec.hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv, spec.hidden)
        w[p + "self_attn.o_proj.weight"] = linear(spec.hidden, q)
        if spec.bias:
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = linear(spec.ffn, spec.hidden)
        w[p + "mlp.up_proj.weight"] = linear(spec.ffn, spec.hidden)
        w[p + "mlp.down_proj.weight"] = linear(spec.hidden, spec.ffn)
    w["model.norm.weight"] = norm()
    if not spec.tied:
        w["lm_head.weight"] = linear(spec.vocab, spec.hidden) * np.float32(2.0)
    return w


def random_head_weights(spec: TinySpec, seed: int = 1) -> dict[str, np.ndarray]:
    """An MTP head for a tiny model (cupyspec/model/mtp.py's names), scaled as `random_weights`."""
    layer = random_weights(TinySpec(**{**spec.__dict__, "layers": 1}), seed)
    rng = np.random.default_rng(seed + 1000)
    head = {name.replace("model.layers.0.", "mtp.layer."): w for name, w in layer.items() if "layers.0." in name}
    head["mtp.enorm.weight"] = (1.0 + 0.1 * rng.standard_normal(spec.hidden)).astype(np.float32)
    head["mtp.hnorm.weight"] = (1.0 + 0.1 * rng.standard_normal(spec.hidden)).astype(np.float32)
    head["mtp.eh_proj.weight"] = (rng.standard_normal((spec.hidden, 2 * spec.hidden))
                                  / np.sqrt(2 * spec.hidden)).astype(np.float32)
    return head


def write_head_file(path: Path, head: dict[str, np.ndarray], format_name: str = "cupyspec-mtp-v1") -> Path:
    save_file(head, str(path), metadata={"format": format_name})
    return path


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _save_bf16(tensors: dict[str, np.ndarray], path: Path) -> None:
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        blob = to_bfloat16_bits(value).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_hf_dir(path: Path, spec: TinySpec, weights: dict[str, np.ndarray], dtype: str = "float32") -> Path:
    """Write config.json, model.safetensors (float32|float16|bfloat16) and the tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM" if spec.arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": spec.arch,
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.eps,
        "max_position_embeddings": spec.max_positions,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if dtype == "bfloat16":
        _save_bf16(weights, path / "model.safetensors")
    elif dtype in ("float32", "float16"):
        save_file({k: v.astype(dtype) for k, v in weights.items()}, str(path / "model.safetensors"))
    else:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `permute` of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for an HF weight name."""
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def gguf_tensors(spec: TinySpec, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 tensors under llama.cpp names, llama's Q/K permuted as llama.cpp's converter does."""
    out = {}
    for name, value in weights.items():
        if spec.arch == "llama" and ("q_proj" in name or "k_proj" in name):
            value = llama_cpp_permute(value, spec.heads if "q_proj" in name else spec.kv_heads)
        out[gguf_name(name)] = np.ascontiguousarray(value, dtype=np.float32)
    return out


def write_gguf(
    path: Path,
    spec: TinySpec,
    weights: dict[str, np.ndarray],
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    arch_name: str | None = None,
    tokenizer_model: str = "gpt2",
) -> Path:
    """Write a GGUF file like llama.cpp's converter; 2-D weights quantized to `tensor_type`, norms F32.

    arch_name / tokenizer_model override the written metadata (to produce unsupported files).
    """
    arch = arch_name or spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(spec.layers)
    w.add_context_length(spec.max_positions)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.eps)
    w.add_vocab_size(spec.vocab)
    w.add_rope_dimension_count(spec.head_dim)
    spec_json = json.loads(_tokenizer_json())
    tok = tiny_tokenizer()
    tokens = [tok.id_to_token(i) for i in range(spec.vocab)]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("gpt-2")  # llama.cpp's name for HF's ByteLevel(use_regex=True) pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec_json["model"]["merges"]])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, value in gguf_tensors(spec, weights).items():
        if value.ndim == 2 and tensor_type != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(value, tensor_type), raw_dtype=tensor_type)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model_paths(tmp_dir: Path, arch: str = "llama", *, tied: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """(HF directory, F32 GGUF file) of one tiny random model."""
    spec = TinySpec(arch=arch, tied=tied)
    weights = random_weights(spec, seed)
    hf_dir = write_hf_dir(Path(tmp_dir) / f"{arch}-hf", spec, weights)
    return hf_dir, write_gguf(Path(tmp_dir) / f"{arch}.gguf", spec, weights)
