"""Weight-only quantization: packing and its twin, GGUF blocks recovered exactly, products over packed
weights, the configuration; on a GPU the packed kernels against fp16 kernels over the dequantized
weights (bit for bit), and the quantized model against the fp16 one."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from golden import GOLDEN_PROMPTS, MAX_TOKENS, generate_greedy

from cupyspec.config import EngineConfig
from cupyspec.model.linear import add_linear, linear
from cupyspec.model.quantized import GROUP, ROUND, QuantizedWeight, dequantize, quantize
from cupyspec.spec_decode.speculative_config import SpeculativeConfig

gpu = pytest.mark.gpu


def _weights(rows: int, depth: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, depth)) * depth ** -0.5).astype(np.float32)


def _as_gguf_loads(w: np.ndarray, gguf_type: GGMLQuantizationType) -> np.ndarray:
    """w quantized to `gguf_type` blocks, as a GGUF file loads them (float32)."""
    return gguf_dequantize(gguf_quantize(w, gguf_type), gguf_type).astype(np.float32)


def _mixed_weights(rows: int, depth: int, seed: int) -> np.ndarray:
    """Weights whose rows 0, 3, 6, ... are Q4_1 blocks and rows 1, 4, 7, ... Q4_0 blocks (negative
    scales among them): each method packs groups of its every kind."""
    w = _weights(rows, depth, seed)
    w[0::3] = _as_gguf_loads(w[0::3], GGMLQuantizationType.Q4_1)
    w[1::3] = _as_gguf_loads(w[1::3], GGMLQuantizationType.Q4_0)
    return w


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_dequantized_weights_lie_within_half_a_step_of_the_weights(method: str) -> None:
    w = _weights(37, 4 * GROUP, seed=1)
    w[3, :GROUP] = 0.25  # a constant group: its scale is 0
    packed = quantize(np, w, method, np.float32)
    assert packed.shape == w.shape and packed.dtype == np.float32
    back = dequantize(np, packed)
    step = np.repeat(packed.scales[..., 0].astype(np.float32), GROUP, axis=1)  # [N, K]
    # half a step of q, and the fp16 roundings of the minimum (wint4) and of the result
    bound = 0.5 * step + 2 * np.abs(w) * 2.0 ** -11 + (0 if method == "wint8" else 2.0 ** -11 * np.abs(w).max())
    assert np.all(np.abs(back - w) <= bound)
    assert np.all(back[3, :GROUP] == np.float32(np.float16(0.25)))


def test_wint4_packs_a_words_even_weights_in_its_low_half_and_its_odd_weights_in_its_high_half() -> None:
    w = np.tile(np.arange(GROUP, dtype=np.float32) % 16, (2, 1))  # q = k % 16: s = 1, m = 0 (min 0, max 15)
    packed = quantize(np, w, "wint4", np.float32)
    assert packed.values.dtype == np.uint8 and packed.values.shape == (2, GROUP // 2)
    # words of q 0..7 and 8..15: bits 4 i hold q 2 i, bits 16 + 4 i hold q 2 i + 1 (little-endian bytes)
    words = packed.values[0, :8].view("<u4")
    np.testing.assert_array_equal(words, [0x75316420, 0xfdb9eca8])
    np.testing.assert_array_equal(packed.scales[0, 0], np.array([1.0, 0.0], np.float16))
    np.testing.assert_array_equal(dequantize(np, packed), w)


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_whole_rounds_are_stored_in_the_order_the_gemv_lanes_read_them(method: str) -> None:
    w = np.tile(np.arange((ROUND + 2) * GROUP, dtype=np.float32) % 16, (2, 1))  # q = k % 16, s = 1, m = 0
    packed = quantize(np, w, method, np.float32)
    word = 8 if method == "wint8" else 4  # bytes of 8 weights
    q_0_to_7 = np.arange(8, dtype=np.uint8) if method == "wint8" else np.array([0x20, 0x64, 0x31, 0x75], np.uint8)
    # the lane of warp 1, quad 2 reads slices 1 + 12 u; u = 3: slice 37, k = 37 * 32 + 16 .. + 23 (q 0..7)
    np.testing.assert_array_equal(packed.values[1, word * ((4 * 1 + 2) * 4 + 3):][:word], q_0_to_7)
    # past the whole round, slices in k order: slice 48, quad 0
    np.testing.assert_array_equal(packed.values[1, word * 4 * ROUND:][:word], q_0_to_7)
    assert packed.scales.shape == (2, ROUND + 4, 2) and not packed.scales[:, ROUND + 2:].any()  # 16-byte rows
    np.testing.assert_array_equal(dequantize(np, packed), w)


@pytest.mark.parametrize("gguf_type,method", [(GGMLQuantizationType.Q8_0, "wint8"),
                                              (GGMLQuantizationType.Q4_1, "wint4"),
                                              (GGMLQuantizationType.Q4_0, "wint4"),
                                              (GGMLQuantizationType.Q4_1, "wint8"),
                                              (GGMLQuantizationType.Q4_0, "wint8"),
                                              (GGMLQuantizationType.Q5_1, "wint8"),
                                              (GGMLQuantizationType.Q5_0, "wint8")])
def test_gguf_blocks_come_back_exactly(gguf_type: GGMLQuantizationType, method: str) -> None:
    """Weights as a GGUF file of these blocks loads them (float32) pack into the same fp16 weights that
    the fp16 path puts on the GPU."""
    loaded = _as_gguf_loads(_weights(64, 8 * GROUP, seed=2), gguf_type)
    np.testing.assert_array_equal(dequantize(np, quantize(np, loaded, method, np.float16)), loaded.astype(np.float16))


def test_wint8_keeps_the_groups_16_levels_hold_and_scales_the_others_symmetrically() -> None:
    w = _mixed_weights(6, 4 * GROUP, seed=7)
    packed = quantize(np, w, "wint8", np.float32)
    q = packed.values.reshape(6, 4, GROUP)  # [N, K/G, G]
    scales, offsets = packed.scales[..., 0], packed.scales[..., 1]  # [N, K/G]
    four_bit, other = [0, 1, 3, 4], [2, 5]
    assert (q[four_bit] >= 0).all() and (q[four_bit] <= 15).all() and (offsets[four_bit] != 0).all()
    assert (scales[1::3] < 0).any()  # a Q4_0 block whose largest magnitude is positive
    assert (np.abs(q[other]).max(axis=2) == 127).all() and (offsets[other] == 0).all()
    np.testing.assert_array_equal(dequantize(np, packed)[four_bit], w[four_bit].astype(np.float16).astype(np.float32))


def _rounded_once(method: str) -> QuantizedWeight:
    """A packed [16, 64] matrix of zeros but for weight (0, 0): q = 9 with s = 1823 / 2^10, m = 2047 / 2^21
    (its group's other weights are m). s q + m lies just below the midpoint of fp16's 16.015625 and
    16.03125: rounded to fp16 once it is the lower; rounded to fp32 first it is the midpoint, whose even
    neighbour is the upper."""
    packed = quantize(np, np.zeros((16, 2 * GROUP), np.float32), method, np.float16)
    packed.scales[0, 0] = [1823 * 2.0 ** -10, 2047 * 2.0 ** -21]
    packed.values[0, 0] = 9  # wint4: the low nibble of the first byte is weight 0
    return packed


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_a_packed_weight_is_s_q_plus_m_rounded_to_fp16_once(method: str) -> None:
    w = dequantize(np, _rounded_once(method))
    assert w[0, 0] == np.float16(16.015625)
    assert (w[0, 1:GROUP] == np.float16(2047 * 2.0 ** -21)).all() and not w[0, GROUP:].any() and not w[1:].any()


def test_rows_must_be_whole_groups_within_fp16s_range() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np, np.zeros((4, 48), np.float32), "wint8", np.float32)
    for method in ("wint8", "wint4"):
        with pytest.raises(ValueError, match=f"{method}: weights beyond fp16's range"):
            quantize(np, np.full((1, GROUP), 1e8, np.float32), method, np.float32)


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_products_with_packed_weights_are_products_with_the_dequantized_weights(method: str) -> None:
    rng = np.random.default_rng(3)
    packed = quantize(np, _weights(40, 2 * GROUP, seed=4), method, np.float32)
    w = dequantize(np, packed)
    x = rng.standard_normal((5, 2 * GROUP)).astype(np.float32)
    np.testing.assert_array_equal(linear(np, x, packed), x @ w.T)
    residual = rng.standard_normal((5, 40)).astype(np.float32)
    want = residual + x @ w.T
    add_linear(np, residual, x, packed)
    np.testing.assert_array_equal(residual, want)


def test_quantization_settings_are_checked_and_normalized() -> None:
    assert EngineConfig(quantization="WINT4").quantization == "wint4"
    assert SpeculativeConfig(method="mtp", num_speculative_tokens=1, quantization="Wint8").quantization == "wint8"
    with pytest.raises(ValueError, match="quantization must be one of wint8, wint4"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="speculative config: quantization"):
        SpeculativeConfig(quantization="fp8")


@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_packed_default_model_gives_the_golden_greedy_outputs_on_the_cpu(default_model_path, method: str) -> None:
    """The default GGUF's matrices are Q4_1, which both methods hold as they are (rounded to fp16 here)."""
    outputs = asyncio.run(generate_greedy(default_model_path, "cpu", [p for p, _ in GOLDEN_PROMPTS], method))
    assert outputs == [expected for _, expected in GOLDEN_PROMPTS]


@pytest.mark.slow
def test_mtp_with_a_packed_head_keeps_the_quantized_models_greedy_outputs() -> None:
    """wint4 (the golden answers, above) drafting with the shipped head in wint8."""
    from cupyspec.engine import AsyncEngine
    from cupyspec.loader import DEFAULT_MODEL
    from cupyspec.sampling.params import SamplingParams

    speculative = SpeculativeConfig(method="mtp", num_speculative_tokens=3, num_model_steps=3, quantization="wint8",
                                    cost_aware_backoff=False)

    async def main() -> list[tuple[str, int]]:
        engine = await AsyncEngine.create(EngineConfig(model=DEFAULT_MODEL, device="cpu", quantization="wint4",
                                                       speculative=speculative))

        async def answer(prompt: str) -> tuple[str, int]:
            text, accepted = "", 0
            async for out in engine.chat([{"role": "user", "content": prompt}],
                                         SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)):
                text += "".join(d.text for d in out.deltas)
                accepted = out.speculate_metrics.num_accepted_tokens if out.speculate_metrics else accepted
            return text, accepted

        try:
            return list(await asyncio.gather(*(answer(p) for p, _ in GOLDEN_PROMPTS)))
        finally:
            await engine.shutdown()

    answers = asyncio.run(main())
    assert [text for text, _ in answers] == [expected for _, expected in GOLDEN_PROMPTS]
    assert sum(accepted for _, accepted in answers) > 0


def test_quantized_logits_stay_near_the_models(default_model_path) -> None:
    """Logits of a 40-token prompt: within the fp16 rounding of the Q4_1 weights, which wint8 holds
    as wint4 does."""
    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
    from cupyspec.model.kv_arrays import KVCacheArrays
    from cupyspec.model.llama import LlamaModel

    loaded = load_model(default_model_path)
    backend = select_backend("cpu")
    flat = build_flat_batch([Segment(np.random.default_rng(0).integers(0, 1000, 40).tolist(), 0, [0, 1, 2])], 16)
    logits = {}
    for method in (None, "wint4", "wint8"):
        model = LlamaModel(loaded.config, loaded.weights, backend, quantization=method)
        kv = KVCacheArrays(np, loaded.config, 4, 16, backend.dtype)
        logits[method] = model.compute_logits(model.forward(DeviceBatch.of(np, flat), kv))  # [40, V]
    assert np.abs(logits["wint4"] - logits[None]).max() < 0.1
    np.testing.assert_array_equal(logits["wint8"], logits["wint4"])


def test_quantized_models_pack_every_decoder_matrix_and_the_mtp_head(default_model_path) -> None:
    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.loader.default_model import shipped_mtp_head
    from cupyspec.model.llama import LlamaModel
    from cupyspec.model.mtp import MTPHead, load_head_weights

    loaded = load_model(default_model_path)
    model = LlamaModel(loaded.config, loaded.weights, select_backend("cpu"), quantization="wint4")
    layer = model.layers[0]
    assert all(isinstance(w, QuantizedWeight) and w.method == "wint4"
               for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(model.lm_head, np.ndarray) and isinstance(model.embed, np.ndarray)
    head_path, _ = shipped_mtp_head("smollm2-135m-instruct")
    head = MTPHead(model, load_head_weights(head_path, loaded.config), "wint8")
    assert isinstance(head.eh_proj, QuantizedWeight) and head.layer.down.method == "wint8"


# ---------------------------------------------------------------- on a GPU

# (N, K): SmolLM2-135M's qkv, o, gate_up, down (one whole round of the gemv); odd N, a K of a single group,
# Ks past whole rounds, and one just short of a round that its padded scales would fill
GPU_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (131, 96), (17, 32), (200, ROUND * GROUP + 64),
              (40, 2 * ROUND * GROUP + 96), (24, (ROUND - 2) * GROUP)]


def _on_device(w: np.ndarray, method: str) -> tuple[QuantizedWeight, Any]:
    """w packed on the GPU, and its dequantized weights as a plain fp16 matrix."""
    import cupy

    packed = quantize(cupy, w, method, np.float16)
    return packed, cupy.asarray(dequantize(np, quantize(np, w, method, np.float16)))


@gpu
@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_dequantize_kernel_gives_the_twins_bits(method: str, n: int, k: int) -> None:
    import cupy

    packed, want = _on_device(_mixed_weights(n, k, seed=n + k), method)
    cupy.testing.assert_array_equal(dequantize(cupy, packed), want)


@gpu
@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_packed_kernels_round_each_weight_to_fp16_once(method: str) -> None:
    """The gemv's weights and the dequantization kernel's are the twin's, where rounding through fp32
    would differ."""
    import cupy

    packed = _rounded_once(method)
    want = cupy.asarray(dequantize(np, packed))
    on_device = QuantizedWeight(cupy.asarray(packed.values), cupy.asarray(packed.scales), method, np.float16)
    cupy.testing.assert_array_equal(dequantize(cupy, on_device), want)
    x = cupy.zeros((1, 2 * GROUP), np.float16)
    x[0, 0] = 1
    cupy.testing.assert_array_equal(linear(cupy, x, on_device, np.float32)[:, 0], want[0, :1].astype(np.float32))


@gpu
@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64, 150, 600])
def test_packed_products_give_the_bits_of_fp16_products_over_the_dequantized_weights(method: str, n: int, k: int,
                                                                                     rows: int) -> None:
    """The gemv up to 8 rows; beyond, the fp16 kernels (tiles, cuBLAS) over dequantized weights."""
    import cupy

    packed, w = _on_device(_mixed_weights(n, k, seed=n * k), method)
    x = cupy.asarray(np.random.default_rng(rows).standard_normal((rows, k)), dtype=np.float16)
    cupy.testing.assert_array_equal(linear(cupy, x, packed), linear(cupy, x, w))
    cupy.testing.assert_array_equal(linear(cupy, x, packed, np.float32), linear(cupy, x, w, np.float32))
    residual = cupy.asarray(np.random.default_rng(rows + 1).standard_normal((rows, n)), dtype=np.float32)
    want = residual.copy()
    add_linear(cupy, want, x, w)
    add_linear(cupy, residual, x, packed)
    cupy.testing.assert_array_equal(residual, want)


@gpu
@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_fused_steps_over_packed_weights_give_the_bits_of_fp16_weights(method: str, rows: int) -> None:
    import cupy

    from cupyspec.model.fused import norm_gate_up_swiglu, norm_qkv_rope
    from cupyspec.model.ops import rope_tables

    heads, kv_heads, head_dim, hidden, ffn = 9, 3, 64, 576, 1536
    rng = np.random.default_rng(rows)
    residual = cupy.asarray(rng.standard_normal((rows, hidden)), dtype=np.float32)
    norm = cupy.asarray(rng.uniform(0.5, 1.5, hidden), dtype=np.float32)
    cos, sin = rope_tables(cupy, head_dim, 10000.0, 64)
    positions = cupy.arange(rows, dtype=np.int32) + 3
    slots = cupy.arange(rows, dtype=np.int32) * 2
    results = []
    for packed_or_fp16 in (0, 1):
        qkv = _on_device(_mixed_weights((heads + 2 * kv_heads) * head_dim, hidden, seed=5), method)[packed_or_fp16]
        gate_up = _on_device(_mixed_weights(2 * ffn, hidden, seed=6), method)[packed_or_fp16]
        k_cache = cupy.zeros((4, 16, kv_heads, head_dim), np.float16)
        v_cache = cupy.zeros_like(k_cache)
        q = norm_qkv_rope(cupy, residual, norm, 1e-5, qkv, None, cos, sin, positions, slots, k_cache, v_cache)
        results.append((q, k_cache, v_cache, norm_gate_up_swiglu(cupy, residual, norm, 1e-5, gate_up)))
    for packed, fp16 in zip(*results):
        cupy.testing.assert_array_equal(packed, fp16)


@gpu
def test_packed_q4_1_models_give_the_fp16_models_logits(default_model_path) -> None:
    """The default GGUF's matrices are Q4_1: wint4 and wint8 hold the very weights the fp16 model
    computes with. Their replayed CUDA-graph steps give the eager logits."""
    import cupy

    from cupyspec.backend import select_backend
    from cupyspec.loader import load_model
    from cupyspec.model.batch import DeviceBatch, Segment, build_flat_batch
    from cupyspec.model.cuda_graphs import CudaGraphs
    from cupyspec.model.kv_arrays import KVCacheArrays
    from cupyspec.model.llama import LlamaModel

    loaded = load_model(default_model_path)
    backend = select_backend("cuda")
    rng = np.random.default_rng(0)
    # a prefill of 40 rows (dequantized weights), steps of 1 and 6 rows (the packed gemv)
    parts = [[(40, 0)], [(1, 40)], [(6, 41)]]
    flats = [build_flat_batch([Segment(rng.integers(0, 1000, n).tolist(), start, [0, 1, 2, 3])], 16)
             for (n, start), in parts]
    logits = {}
    for method in (None, "wint4", "wint8"):
        model = LlamaModel(loaded.config, loaded.weights, backend, quantization=method)
        kv = KVCacheArrays(cupy, loaded.config, 8, 16, backend.dtype)
        stream = cupy.cuda.Stream(non_blocking=True)
        graphs = CudaGraphs(model, kv, stream, 8, 128, cupy.zeros(1, np.int32))
        with stream:
            logits[method] = [model.compute_logits(model.forward(DeviceBatch.of(cupy, f), kv)).get() for f in flats]
            if method is not None:
                for flat, eager in zip(flats[1:], logits[method][1:]):
                    np.testing.assert_array_equal(graphs.run(flat).logits.get(), eager)
    for fp16, wint4, wint8 in zip(logits[None], logits["wint4"], logits["wint8"]):
        np.testing.assert_array_equal(wint4, fp16)
        np.testing.assert_array_equal(wint8, fp16)


@gpu
@pytest.mark.parametrize("method", ["wint8", "wint4"])
def test_packed_default_model_gives_the_golden_greedy_outputs_on_the_gpu(default_model_path, method: str) -> None:
    outputs = asyncio.run(generate_greedy(default_model_path, "cuda", [p for p, _ in GOLDEN_PROMPTS], method))
    assert outputs == [expected for _, expected in GOLDEN_PROMPTS]
