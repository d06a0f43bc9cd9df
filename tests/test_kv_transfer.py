"""KV blocks moved between two processes' pools through NIXL, on the CPU (DRAM to DRAM over UCX) and
on a GPU (VRAM to VRAM): the blocks read are the peer's, in every layer's K and V, and the peer is
notified."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time

import numpy as np
import pytest

pytest.importorskip("nixl", reason="KV transfer needs NIXL: pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1")

from tiny_models import TinySpec  # noqa: E402

from cupyspec.config import ModelConfig  # noqa: E402
from cupyspec.disagg.kv_transfer import KVTransferAgent, KVTransferError, PoolLayout  # noqa: E402
from cupyspec.model.kv_arrays import KVCacheArrays  # noqa: E402

TIMEOUT = 30  # seconds any one wait of the test may take


def array_module(device: str):
    if device == "cpu":
        return np
    import cupy
    return cupy


def pool(num_blocks: int, fill: bool, device: str = "cpu") -> KVCacheArrays:
    """A pool of a small model's shape (an MTP head's layer included) in host or GPU memory; filled
    with distinct values."""
    spec, xp = TinySpec(), array_module(device)
    config = ModelConfig("llama", 64, spec.hidden, spec.ffn, 2, spec.heads, spec.kv_heads, spec.head_dim,
                         1e4, 1e-5, 512, False, False, None, (0,))
    kv = KVCacheArrays(xp, config, num_blocks, 4, np.float32, extra_layers=1)
    if fill:
        kv.k[...] = xp.arange(kv.k.size, dtype=np.float32).reshape(kv.k.shape)
        kv.v[...] = -kv.k
    return kv


def on_host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


def serve_prefill_pool(layouts: multiprocessing.Queue, notes: multiprocessing.Queue, device: str) -> None:
    """The peer process: publish a filled pool's layout, then report the first notification."""
    agent = KVTransferAgent("prefill", pool(24, fill=True, device=device), "float16")
    if device != "cpu":
        array_module(device).cuda.Device().synchronize()
    layouts.put(agent.layout())
    for _ in range(TIMEOUT * 100):
        received = agent.notifications()
        if received:
            notes.put(received)
            break
        time.sleep(0.01)
    agent.close()


def start_peer(device: str = "cpu") -> tuple[multiprocessing.Process, PoolLayout, multiprocessing.Queue]:
    """The peer process, its pool's layout, and the queue of the notifications it receives."""
    context = multiprocessing.get_context("spawn")
    layouts, notes = context.Queue(), context.Queue()
    peer = context.Process(target=serve_prefill_pool, args=(layouts, notes, device), daemon=True)
    peer.start()
    return peer, layouts.get(timeout=TIMEOUT), notes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_blocks_read_from_another_process_are_the_peers_and_the_peer_is_notified(device):
    peer, layout, notes = start_peer(device)
    try:
        kv = pool(10, fill=False, device=device)
        agent = KVTransferAgent("decode", kv, "float16")
        name = agent.connect(layout)
        assert layout.memory == ("DRAM" if device == "cpu" else "VRAM")
        remote, local = [3, 7, 8, 9, 12, 13], [0, 1, 2, 3, 5, 7]  # runs: 3, 7-9, 12, 13
        agent.read(name, remote, local, b"done:req-1").wait(TIMEOUT)
        source = pool(24, fill=True)
        k, v = on_host(kv.k), on_host(kv.v)
        np.testing.assert_array_equal(k[:, local], source.k[:, remote])
        np.testing.assert_array_equal(v[:, local], source.v[:, remote])
        assert not k[:, [4, 6, 8, 9, 10]].any() and not v[:, [4, 6, 8, 9, 10]].any()  # no other block written
        assert notes.get(timeout=TIMEOUT) == [("decode", b"done:req-1")]
        agent.close()
    finally:
        peer.join(timeout=TIMEOUT)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0


def test_a_pool_of_another_shape_or_other_weights_is_refused():
    agent = KVTransferAgent("a", pool(4, fill=False), "float16")
    other = KVTransferAgent("b", pool(4, fill=False), "wint4")
    with pytest.raises(KVTransferError, match=r"float16 weights\) does not match ours \(.*wint4\).*--quantization"):
        other.connect(agent.layout())
    layout = agent.layout()
    narrower = dataclasses.replace(layout, regions=layout.regions[:-2])
    with pytest.raises(KVTransferError, match="does not match ours"):
        agent.connect(narrower)
    agent.close()
    other.close()


def test_reading_from_a_process_that_died_fails_with_a_transfer_error():
    peer, layout, _ = start_peer()
    agent = KVTransferAgent("decode", pool(10, fill=False), "float16")
    name = agent.connect(layout)
    peer.kill()
    peer.join(timeout=TIMEOUT)
    with pytest.raises(KVTransferError):
        agent.read(name, [1], [1], b"").wait(TIMEOUT)
    agent.close()
