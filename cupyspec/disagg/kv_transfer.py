"""KV blocks moved between two engines' pools through NIXL, NVIDIA's transfer library (UCX beneath
it: shared memory or TCP within a host, CUDA IPC between its GPUs, RDMA across hosts where the
NICs have it).

Each engine's `KVTransferAgent` registers its pool, every layer's K and V array, and publishes a
`PoolLayout`: its NIXL metadata and the arrays' addresses. The reader pulls, as vLLM's
NixlConnector does: the decode side connects to the prefill side's layout and READs the blocks it
lacks into blocks of its own pool, one region per array for each run of blocks consecutive on both
sides; the transfer's notification tells the prefill side that it may release them. Layouts travel
in the servers' own control messages (HTTP), so no agent listens for metadata. Agents run no
progress thread: both sides make progress in their own calls, the reader waiting for its transfer
and the prefill side polling its notifications every few milliseconds (engine/handoff_roles.py),
which also serves reads of its pool.

NIXL's Python package declares PyTorch as a dependency for a module this one does not use; install
it without: `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` (nixl-cu13 for CUDA 13).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cupyspec.model.kv_arrays import KVCacheArrays

POLL_SECONDS = 0.0002  # between two looks at the transfers in flight


@dataclass(frozen=True)
class PoolLayout:
    """Where a pool's blocks lie, as its owner publishes it to peers."""

    agent: str  # the owner's NIXL agent name
    metadata: bytes  # the owner's NIXL agent metadata (registrations included)
    regions: tuple[int, ...]  # base address of each layer's K array, then of each layer's V array
    blocks_per_region: int  # blocks in each array, the scratch block included
    block_bytes: int
    memory: str  # "DRAM" or "VRAM"
    device: int  # the GPU of VRAM (0 for DRAM)
    weights: str  # what the K/V is computed with: the weights' dtype ("float16") or quantization ("wint4")


class KVTransferError(RuntimeError):
    """A transfer failed or its peer went away."""


def _nixl(gpu: bool) -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent's set-up at INFO
    if gpu:
        # UCX reads a peer's GPU memory through CUDA IPC only where it finds NVLink; elsewhere (two
        # processes on one GPU, or GPUs on PCIe) it emulates the read over TCP, a hundred times slower
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    try:
        from nixl import _api
    except ImportError as exc:
        raise ImportError(f"KV transfer needs NIXL ({exc}); install it with "
                          "`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`") from None
    return _api


class KVTransferAgent:
    """One engine's NIXL agent over its KV pool. A transfer's first post may do the whole copy before
    it returns (shared memory within a host): call `read` from a worker thread, not an event loop."""

    def __init__(self, name: str, kv: KVCacheArrays, weights: str) -> None:
        arrays = [*kv.k, *kv.v]  # each layer's [blocks + 1, block_size, Hkv, D]
        first = arrays[0]
        self._memory = "DRAM" if isinstance(first, np.ndarray) else "VRAM"
        api = _nixl(self._memory == "VRAM")
        self.name = name
        # No progress thread (NIXL's polls without pause, a core's worth): transfers and notifications
        # progress in our own calls, which may come from several threads, hence the agent's lock.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = api.nixl_agent(name, config)
        self._kv = kv  # the registered memory stays allocated while the agent lives
        self._device = 0 if self._memory == "DRAM" else first.device.id
        self._regions = tuple(_address(a) for a in arrays)
        self._blocks, self._block_bytes = first.shape[0], first[0].nbytes
        whole = kv.k.nbytes // len(kv.k)
        self._registered = self._agent.register_memory(
            [(address, whole, self._device, "") for address in self._regions], self._memory)
        self._weights = weights
        self._peers: dict[str, PoolLayout] = {}  # agent name -> its pool

    def layout(self) -> PoolLayout:
        return PoolLayout(self.name, self._agent.get_agent_metadata(), self._regions, self._blocks,
                          self._block_bytes, self._memory, self._device, self._weights)

    def connect(self, peer: PoolLayout) -> str:
        """Add a peer's pool (once per agent name); its agent name, for `read`. KVTransferError where
        its blocks are not ours (another model, weights, block size or MTP head)."""
        if peer.agent not in self._peers:
            theirs = (len(peer.regions), peer.block_bytes, peer.weights)
            if theirs != (len(self._regions), self._block_bytes, self._weights):
                raise KVTransferError(
                    f"KV pool of {peer.agent!r} ({theirs[0]} arrays of {theirs[1]}-byte blocks, {theirs[2]} weights) "
                    f"does not match ours ({len(self._regions)} of {self._block_bytes}, {self._weights}): the servers "
                    "must run the same model, weights (--quantization), block size and MTP head")
            self._agent.add_remote_agent(peer.metadata)
            self._peers[peer.agent] = peer
        return peer.agent

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int],
             notification: bytes) -> Transfer:
        """Start copying the peer's blocks `remote_blocks` into ours `local_blocks`, in every layer's K
        and V; the peer gets `notification` once the copy is done. Blocks consecutive on both sides
        move as one region per array: a transfer costs per region more than per byte."""
        layout = self._peers[peer]
        remote_start, local_start, count = _runs(remote_blocks, local_blocks)
        local = _descs(self._regions, local_start, count, self._block_bytes, self._device)
        remote = _descs(layout.regions, remote_start, count, self._block_bytes, layout.device)
        handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, self._memory),
                                             self._agent.get_xfer_descs(remote, layout.memory), peer, notification)
        return Transfer(self._agent, handle)

    def notify(self, peer: str, message: bytes) -> None:
        """Send a connected peer a notification without a transfer (KVTransferError if it is gone)."""
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:  # nixlRemoteDisconnectError and kin
            raise KVTransferError(f"notifying {peer!r} failed: {exc}") from exc

    def notifications(self) -> list[tuple[str, bytes]]:
        """The notifications that arrived since the last call: (sender's agent name, message)."""
        return [(peer, message) for peer, messages in self._agent.get_new_notifs().items() for message in messages]

    def close(self) -> None:
        """Forget the peers and release the pool's registration."""
        for name in self._peers:
            self._agent.remove_remote_agent(name)
        self._peers.clear()
        self._agent.deregister_memory(self._registered)


class Transfer:
    """A posted READ: `wait` for it (bounded), or `done` to poll it."""

    def __init__(self, agent: Any, handle: Any) -> None:
        self._agent, self._handle = agent, handle
        self._state = self._step(agent.transfer)

    def _step(self, fn: Any) -> str:
        """fn(handle)'s state of the transfer; its handle released once it has ended either way."""
        try:
            state = fn(self._handle)
        except Exception as exc:  # nixlRemoteDisconnectError and kin: the peer is gone
            state, error = "ERR", exc
        else:
            error = None
        if state != "PROC":
            self._handle.release()
        if state == "ERR":
            raise KVTransferError(f"KV transfer failed{f': {error}' if error else ''}") from error
        return state

    def done(self) -> bool:
        """Whether the copy has finished (KVTransferError if it failed)."""
        if self._state == "PROC":
            self._state = self._step(self._agent.check_xfer_state)
        return self._state == "DONE"

    def abandon(self) -> None:
        """Give up a copy in progress: its handle is released."""
        if self._state == "PROC":
            self._handle.release()
            self._state = "ERR"

    def wait(self, timeout: float) -> None:
        """Return once the copy has finished; KVTransferError if it failed or took over `timeout` s
        (then it is abandoned)."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() > deadline:
                self.abandon()
                raise KVTransferError(f"KV transfer not done after {timeout} s")
            time.sleep(POLL_SECONDS)


def _runs(remote: Sequence[int], local: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of block pairs consecutive on both sides: each run's remote and local first block,
    and its length (each [R] int64)."""
    remote, local = np.asarray(remote, np.int64), np.asarray(local, np.int64)
    breaks = np.flatnonzero((np.diff(remote) != 1) | (np.diff(local) != 1)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    return remote[starts], local[starts], np.diff(np.append(starts, len(remote)))


def _descs(regions: Sequence[int], first: np.ndarray, count: np.ndarray, block_bytes: int, device: int) -> np.ndarray:
    """[regions * R, 3] uint64: (address, bytes, device) of each run (first block [R], length [R]) in
    every region, region by region."""
    addresses = np.asarray(regions, np.uint64)[:, None] + first.astype(np.uint64) * np.uint64(block_bytes)
    sizes = np.broadcast_to(count.astype(np.uint64) * np.uint64(block_bytes), addresses.shape)
    return np.stack([addresses.reshape(-1), sizes.reshape(-1), np.full(addresses.size, device, np.uint64)], axis=1)


def _address(array: Any) -> int:
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr
