"""KV blocks moved between two engines' pools through NIXL, NVIDIA's transfer library (UCX beneath
it: shared memory or TCP within a host, CUDA IPC between its GPUs, RDMA across hosts where the
NICs have it).

Each engine's `KVTransferAgent` registers its pool, every layer's K and V array, each block of
which is one contiguous region, and publishes a `PoolLayout`: its NIXL metadata and the arrays'
addresses. The reader pulls, as vLLM's NixlConnector does: the decode side connects to the prefill
side's layout and READs the blocks it lacks into blocks of its own pool; the transfer's notification
tells the prefill side that it may release them. Layouts travel in the servers' own control
messages (HTTP), so no agent listens for metadata. Agents run no progress thread: both sides make
progress in their own calls, the reader waiting for its transfer and the prefill side polling its
notifications every few milliseconds (engine/handoff_roles.py), which also serves reads of its pool.

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

LOCAL_AGENT = "NIXL_INIT_AGENT"  # NIXL's name for the calling agent in a descriptor list


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


class KVTransferError(RuntimeError):
    """A transfer failed or its peer went away."""


def _nixl() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent's set-up at INFO
    try:
        from nixl import _api
    except ImportError as exc:
        raise ImportError(f"KV transfer needs NIXL ({exc}); install it with "
                          "`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`") from None
    return _api


class KVTransferAgent:
    """One engine's NIXL agent over its KV pool. A transfer's first post may do the whole copy before
    it returns (shared memory within a host): call `read` from a worker thread, not an event loop."""

    def __init__(self, name: str, kv: KVCacheArrays) -> None:
        api = _nixl()
        self.name = name
        # No progress thread (NIXL's polls without pause, a core's worth): transfers and notifications
        # progress in our own calls, which may come from several threads, hence the agent's lock.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = api.nixl_agent(name, config)
        self._kv = kv  # the registered memory stays allocated while the agent lives
        arrays = [*kv.k, *kv.v]  # each layer's [blocks + 1, block_size, Hkv, D]
        first = arrays[0]
        self._memory = "DRAM" if isinstance(first, np.ndarray) else "VRAM"
        self._device = 0 if self._memory == "DRAM" else first.device.id
        self._regions = tuple(_address(a) for a in arrays)
        self._blocks, self._block_bytes = first.shape[0], first[0].nbytes
        whole = kv.k.nbytes // len(kv.k)
        self._registered = self._agent.register_memory(
            [(address, whole, self._device, "") for address in self._regions], self._memory)
        self._local = self._agent.prep_xfer_dlist(LOCAL_AGENT, self._block_descs(self.layout()), self._memory)
        self._peers: dict[str, tuple[Any, int]] = {}  # agent name -> (its prepared blocks, blocks per region)

    def layout(self) -> PoolLayout:
        return PoolLayout(self.name, self._agent.get_agent_metadata(), self._regions, self._blocks,
                          self._block_bytes, self._memory, self._device)

    def _block_descs(self, layout: PoolLayout) -> np.ndarray:
        """[regions * blocks, 3] uint64: (address, bytes, device) of every block of every region,
        region by region."""
        offsets = np.arange(layout.blocks_per_region, dtype=np.uint64) * np.uint64(layout.block_bytes)
        addresses = (np.asarray(layout.regions, dtype=np.uint64)[:, None] + offsets).reshape(-1)
        return np.stack([addresses, np.full_like(addresses, layout.block_bytes),
                         np.full_like(addresses, layout.device)], axis=1)

    def connect(self, peer: PoolLayout) -> str:
        """Add a peer's pool (once per agent name); its agent name, for `read`."""
        if peer.agent not in self._peers:
            if (len(peer.regions), peer.block_bytes) != (len(self._regions), self._block_bytes):
                raise ValueError(f"KV pool of {peer.agent!r} ({len(peer.regions)} arrays of {peer.block_bytes}-byte "
                                 f"blocks) does not match ours ({len(self._regions)} of {self._block_bytes})")
            name = self._agent.add_remote_agent(peer.metadata)
            name = name.decode() if isinstance(name, bytes) else name
            blocks = self._agent.prep_xfer_dlist(name, self._block_descs(peer), peer.memory)
            self._peers[peer.agent] = (blocks, peer.blocks_per_region)
        return peer.agent

    def read(self, peer: str, remote_blocks: Sequence[int], local_blocks: Sequence[int],
             notification: bytes) -> Transfer:
        """Start copying the peer's blocks `remote_blocks` into ours `local_blocks`, in every layer's K
        and V; the peer gets `notification` once the copy is done."""
        remote, remote_per_region = self._peers[peer]
        regions = np.arange(len(self._regions))[:, None]
        local_index = (regions * self._blocks + np.asarray(local_blocks)).reshape(-1)
        remote_index = (regions * remote_per_region + np.asarray(remote_blocks)).reshape(-1)
        handle = self._agent.make_prepped_xfer("READ", self._local, local_index.tolist(), remote,
                                               remote_index.tolist(), notification)
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
        for name, (blocks, _) in self._peers.items():
            blocks.release()
            self._agent.remove_remote_agent(name)
        self._peers.clear()
        self._local.release()
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

    def wait(self, timeout: float) -> None:
        """Return once the copy has finished; KVTransferError if it failed or took over `timeout` s
        (then it is abandoned)."""
        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() > deadline:
                self._handle.release()
                self._state = "ERR"
                raise KVTransferError(f"KV transfer not done after {timeout} s")
            time.sleep(0.0002)


def _address(array: Any) -> int:
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr
