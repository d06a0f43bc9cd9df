"""Decode role: the prefill servers a decode engine hands its prompts to, over HTTP, and the fetch of
each prompt's K/V from the server that ran it, through NIXL.

A prompt goes to the server with the fewest prompts in flight from here, ties taken in turn; a
server that cannot be reached, fails or times out is skipped for the next one, and its pool is
looked up again next time. The K/V READ's notification (the handoff id) tells the prefill server
to release its blocks; where nothing is read (the first token ended the request, or the pool had
no room) a bare notification does.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

import aiohttp
import msgspec

from cupyspec.disagg.handoff import FetchBlocks, PrefilledPrompt
from cupyspec.disagg.kv_transfer import POLL_SECONDS, KVTransferAgent, KVTransferError, PoolLayout, Transfer
from cupyspec.errors import InvalidRequestError, PrefillUnavailableError
from cupyspec.sampling.params import SamplingParams

log = logging.getLogger("cupyspec")

PREFILL_ROUTE = "/v1/disagg/prefill"
LAYOUT_ROUTE = "/v1/disagg/layout"


class PrefillBody(msgspec.Struct, frozen=True):
    """What a decode server sends a prefill server: the prompt, its sampling and its choice's key."""

    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_key: int


class ReadThread:
    """Posts the K/V reads and drives them to their end on a thread of its own, which looks at every
    read in flight in turn (a thread per read would poll as many times over, each poll taking the
    interpreter lock from the engine)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (post, timeout, future, loop), or None: stop
        self._thread = threading.Thread(target=self._run, name="cupyspec-kv-reads", daemon=True)
        self._thread.start()

    def read(self, post: Callable[[], Transfer], timeout: float) -> asyncio.Future:
        """The end of the transfer `post` starts: its future's exception is KVTransferError where it
        failed or took over `timeout` s."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((post, timeout, future, loop))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        pending: list[tuple[Transfer, float, asyncio.Future, asyncio.AbstractEventLoop]] = []
        while True:
            try:
                item = self._queue.get(timeout=POLL_SECONDS) if pending else self._queue.get()
            except queue.Empty:
                item = ()
            if item is None:
                for transfer, _, future, loop in pending:
                    transfer.abandon()
                    _settle(future, loop, KVTransferError("the engine is shutting down"))
                return
            if item:
                post, timeout, future, loop = item
                try:
                    pending.append((post(), time.monotonic() + timeout, future, loop))
                except Exception as exc:  # noqa: BLE001 - the reader computes the prompt itself
                    _settle(future, loop, exc)
            pending = [entry for entry in pending if not _ended(*entry)]


def _ended(transfer: Transfer, deadline: float, future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> bool:
    """Whether a read in flight has ended (its future then settled)."""
    try:
        if transfer.done():
            _settle(future, loop, None)
            return True
        if time.monotonic() > deadline:
            transfer.abandon()
            raise KVTransferError("KV transfer timed out")
    except KVTransferError as exc:
        _settle(future, loop, exc)
        return True
    return False


def _settle(future: asyncio.Future, loop: asyncio.AbstractEventLoop, error: BaseException | None) -> None:
    def settle() -> None:
        if not future.done():  # (its waiter may have been cancelled)
            future.set_result(None) if error is None else future.set_exception(error)
    loop.call_soon_threadsafe(settle)


class PrefillServers:
    """The prefill servers at `urls`, least loaded first, each reached through `agent`."""

    def __init__(self, urls: tuple[str, ...], agent: KVTransferAgent, timeout: float) -> None:
        self.urls, self.agent, self.timeout = urls, agent, timeout
        self.in_flight = dict.fromkeys(urls, 0)
        self._turn = 0  # the server that goes first among equally loaded ones, advanced at every prompt
        self._peers: dict[str, str] = {}  # url -> the server's agent name, once connected
        self._session: aiohttp.ClientSession | None = None
        self._reads = ReadThread()

    async def prefill(self, prompt: list[int], params: SamplingParams, key: int) -> tuple[PrefilledPrompt, FetchBlocks]:
        """The prompt run by the first server that answers, and the fetch of its K/V. InvalidRequestError
        if a server refuses the request; PrefillUnavailableError if none answers."""
        body = msgspec.json.encode(PrefillBody(prompt, params, key))
        errors, first = [], self._turn
        self._turn = (first + 1) % len(self.urls)
        for url in sorted(self.urls[first:] + self.urls[:first], key=self.in_flight.__getitem__):
            self.in_flight[url] += 1
            try:
                peer = await self._peer(url)
                prefilled = msgspec.json.decode(await self._post(url + PREFILL_ROUTE, body), type=PrefilledPrompt)
                return prefilled, self._fetch(peer, prefilled.handoff_id)
            except (aiohttp.ClientError, asyncio.TimeoutError, KVTransferError, msgspec.DecodeError) as exc:
                log.warning("prefill server %s failed: %r", url, exc)
                errors.append(f"{url}: {exc!r}")
                self._peers.pop(url, None)
            finally:
                self.in_flight[url] -= 1
        raise PrefillUnavailableError(f"no prefill server ran the prompt ({'; '.join(errors)})")

    async def _peer(self, url: str) -> str:
        """The agent name of the server at `url`, its pool connected on first use."""
        if url not in self._peers:
            layout = msgspec.json.decode(await self._get(url + LAYOUT_ROUTE), type=PoolLayout)
            self._peers[url] = self.agent.connect(layout)
        return self._peers[url]

    def _fetch(self, peer: str, handoff_id: str) -> FetchBlocks:
        async def fetch(remote: list[int], local: list[int]) -> None:
            if remote:
                await self._reads.read(lambda: self.agent.read(peer, remote, local, handoff_id.encode()), self.timeout)
            else:
                self.agent.notify(peer, handoff_id.encode())
        return fetch

    async def _post(self, url: str, body: bytes) -> bytes:
        async with self._client().post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            payload = await response.read()
            if response.status == 400:
                raise InvalidRequestError(msgspec.json.decode(payload).get("error", {}).get("message", "bad request"))
            response.raise_for_status()
            return payload

    async def _get(self, url: str) -> bytes:
        async with self._client().get(url) as response:
            response.raise_for_status()
            return await response.read()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def close(self) -> None:
        self._reads.close()
        if self._session is not None:
            await self._session.close()
