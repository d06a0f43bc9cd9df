"""tools/train_mtp.py: the PyTorch target against the reference, the head's unrolled steps against
inference order, training, the head file, and the acceptance counting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import train_mtp as tm
from reference_model import reference_logits
from safetensors import safe_open
from safetensors.numpy import load_file
from tiny_models import tiny_model_paths

from cupyspec.loader import load_model

needs_torch = pytest.mark.skipif(tm.torch is None, reason="PyTorch is not installed")
torch = tm.torch
if torch is not None:
    from mtp_torch import rope_tables


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    hf_dir, _ = tiny_model_paths(tmp_path_factory.mktemp(request.param), request.param)
    return hf_dir, load_model(str(hf_dir))


def _target(loaded):
    return tm.TargetModel(loaded.config, loaded.weights, torch.float32, torch.device("cpu"))


def _samples(loaded, count: int, length: int, prompt_len: int, seed: int = 0) -> list[tm.Sample]:
    rng = np.random.default_rng(seed)
    return [tm.Sample(rng.integers(3, loaded.config.vocab_size, length), prompt_len, True) for _ in range(count)]


def test_acceptance_summary_counts_runs_of_accepted_steps():
    hits = np.array([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=bool)
    summary = tm.acceptance_summary(hits)
    assert summary["num_chains"] == 4
    assert summary["cumulative_acceptance"] == [0.75, 0.5, 0.25]  # steps 1..j all right
    assert summary["conditional_acceptance"] == [0.75, 0.6667, 0.5]  # step j right, given 1..j-1 right
    assert summary["mean_acceptance_length"] == {"1": 1.75, "2": 2.25, "3": 2.5}


def test_acceptance_summary_of_no_chains_is_zero():
    summary = tm.acceptance_summary(np.zeros((0, 2), dtype=bool))
    assert summary["cumulative_acceptance"] == [0.0, 0.0]
    assert summary["mean_acceptance_length"] == {"1": 1.0, "2": 1.0}


@needs_torch
def test_target_forward_matches_reference_logits_in_padded_batches(tiny):
    _, loaded = tiny
    target = _target(loaded)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (21, 9)]
    tokens = torch.zeros((2, 21), dtype=torch.int64)
    tokens[0], tokens[1, :9] = torch.tensor(seqs[0]), torch.tensor(seqs[1])
    logits = target.logits(target.hidden_states(tokens)).numpy()  # [2, 21, V]
    for row, seq in enumerate(seqs):
        ref = reference_logits(loaded.config, loaded.weights, seq)
        assert np.abs(ref).max() > 0.1
        np.testing.assert_allclose(logits[row, :len(seq)], ref, rtol=0, atol=1e-4)


def _inference_chain(head, target, h, tokens, start: int, num_steps: int) -> list:
    """The head as inference runs it, one position at a time on its own K/V cache: over positions
    0..start with the target's hidden states, then steps 2..num_steps on its own outputs, with the
    sequence's tokens as drafts. The output hidden state of each step of the chain begun at `start`."""
    cos, sin = rope_tables(target.config, len(tokens), h.device)
    cache: list = []

    def run(state, token: int, position: int):
        e = head.enorm(target.model.embed_tokens(torch.tensor([[token]])))
        u = head.eh_proj(torch.cat([e, head.hnorm(state[None, None])], dim=-1))
        keys = sum(k.shape[2] for k, _ in cache) + 1
        mask = torch.ones((1, keys), dtype=torch.bool)
        return head.layer(u, cos[position:position + 1], sin[position:position + 1], cache, mask)[0, 0]

    for position in range(start + 1):
        r = run(h[position], int(tokens[position + 1]), position)
    outputs = [r]
    for step in range(2, num_steps + 1):
        r = run(r, int(tokens[start + step]), start + step - 1)
        outputs.append(r)
    return outputs


@needs_torch
def test_unrolled_head_steps_equal_inference_order(tiny):
    _, loaded = tiny
    target = _target(loaded)
    head = tm.MTPHead.from_target(target)
    with torch.no_grad():  # away from the pass-through start, so that every input matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    tokens = torch.from_numpy(_samples(loaded, 1, 20, 5)[0].tokens)
    h = target.hidden_states(tokens[None])
    with torch.no_grad():
        unrolled = head(h, tm.F.pad(tokens[None, 1:], (0, 1)), target, 3)  # 3 x [1, 20, H]
        for start in (0, 4, 11, 16):
            chain = _inference_chain(head, target, h[0], tokens, start, 3)
            for step, r in enumerate(chain):
                torch.testing.assert_close(unrolled[step][0, start + step], r, rtol=0, atol=1e-5)


@needs_torch
def test_training_reduces_the_distillation_loss(tiny):
    _, loaded = tiny
    target = _target(loaded)
    head = tm.MTPHead.from_target(target)
    samples = _samples(loaded, 6, 24, 8)
    opts = tm.TrainOptions(steps=30, batch_size=6, lr=3e-3, warmup_steps=2, log_every=10)
    losses = tm.train_head(target, head, samples, opts)
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.9 * losses[0]


@needs_torch
def test_saved_head_has_the_spec_names_shapes_and_metadata(tiny, tmp_path):
    _, loaded = tiny
    c = loaded.config
    head = tm.MTPHead.from_target(_target(loaded))
    digest = tm.save_head(head, 3, tmp_path / "mtp.safetensors")
    h, q, kv, f = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    expected = {
        "mtp.enorm.weight": (h,), "mtp.hnorm.weight": (h,), "mtp.eh_proj.weight": (h, 2 * h),
        "mtp.layer.input_layernorm.weight": (h,),
        "mtp.layer.self_attn.q_proj.weight": (q, h), "mtp.layer.self_attn.k_proj.weight": (kv, h),
        "mtp.layer.self_attn.v_proj.weight": (kv, h), "mtp.layer.self_attn.o_proj.weight": (h, q),
        "mtp.layer.post_attention_layernorm.weight": (h,),
        "mtp.layer.mlp.gate_proj.weight": (f, h), "mtp.layer.mlp.up_proj.weight": (f, h),
        "mtp.layer.mlp.down_proj.weight": (h, f),
    }
    if c.attention_bias:
        expected |= {"mtp.layer.self_attn.q_proj.bias": (q,), "mtp.layer.self_attn.k_proj.bias": (kv,),
                     "mtp.layer.self_attn.v_proj.bias": (kv,)}
    tensors = load_file(str(tmp_path / "mtp.safetensors"))
    assert {name: t.shape for name, t in tensors.items()} == expected
    assert all(t.dtype == np.float16 for t in tensors.values())
    np.testing.assert_array_equal(tensors["mtp.eh_proj.weight"][:, h:], np.eye(h))  # passes h through at first
    last_layer_down = loaded.weights[f"model.layers.{c.num_layers - 1}.mlp.down_proj.weight"]
    np.testing.assert_array_equal(tensors["mtp.layer.mlp.down_proj.weight"], last_layer_down.astype(np.float16))
    with safe_open(str(tmp_path / "mtp.safetensors"), "np") as handle:
        assert handle.metadata() == {
            "format": "cupyspec-mtp-v1", "hidden_state": "last-layer residual before the final norm",
            "target_vocab_size": str(c.vocab_size), "target_hidden_size": str(h), "num_model_steps": "3"}
    assert len(digest) == 64


@needs_torch
def test_tool_generates_trains_evaluates_and_reuses_its_data_on_the_cpu(tmp_path):
    hf_dir, _ = tiny_model_paths(tmp_path, "llama")
    questions = ["What is the capital of France, and why?", "Write a python function that adds two numbers.",
                 "Tell me about the quick brown fox and the lazy dog.", "How does speculative decoding work?",
                 "List the numbers from one to ten, please.", "Say hello world in three languages."]
    conversations = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "An answer. " * 8}]}
                     for q in questions]
    (tmp_path / "sharegpt.json").write_text(json.dumps(conversations))
    common = ["--model", str(hf_dir), "--device", "cpu", "--batch-size", "4", "--log-every", "2",
              "--num-model-steps", "2"]
    report = tm.main([*common, "--out-dir", str(tmp_path / "run"), "--dataset-path", str(tmp_path / "sharegpt.json"),
                      "--num-prompts", "3", "--max-answer-tokens", "12", "--sampled-share", "0.5",
                      "--held-out-prompts", "3", "--eval-prompts", "2", "--steps", "4"])
    data = np.load(tmp_path / "run" / "data.npz")
    assert data["held_out"].sum() == report["held_out_sequences"] == 2  # the two eval prompts' greedy answers
    assert (data["prompt_lens"] < data["lengths"]).all()
    assert report["num_chains"] > 0 and set(report["mean_acceptance_length"]) == {"1", "2"}
    assert report["target_agreement"] == 1.0  # the PyTorch target picks the engine's greedy tokens
    assert json.loads((tmp_path / "run" / "eval.json").read_text()) == report
    head_names = set(load_file(str(tmp_path / "run" / "mtp.safetensors")))
    assert {"mtp.eh_proj.weight", "mtp.layer.mlp.up_proj.weight"} <= head_names
    again = tm.main([*common, "--out-dir", str(tmp_path / "again"), "--data", str(tmp_path / "run" / "data.npz"),
                     "--steps", "2"])
    assert again["train_sequences"] == report["train_sequences"]
    assert not (tmp_path / "again" / "data.npz").exists()
