"""The decode role's K/V reads, driven on one thread: each read's future ends with it, a failed or
late read raises KVTransferError (a late one abandoned), and shutting down ends those in flight."""

from __future__ import annotations

import asyncio

import pytest

from cupyspec.disagg.kv_transfer import KVTransferError
from cupyspec.disagg.prefill_client import ReadThread


class FakeTransfer:
    """A transfer that is done after `polls` looks (never, for None), or fails at the first."""

    def __init__(self, polls: int | None, fails: bool = False) -> None:
        self.polls, self.fails, self.abandoned = polls, fails, False

    def done(self) -> bool:
        if self.fails:
            raise KVTransferError("the peer went away")
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls <= 0

    def abandon(self) -> None:
        self.abandoned = True


def test_reads_end_as_their_transfers_do():
    async def main() -> list[object]:
        reads = ReadThread()
        done, failed, late = FakeTransfer(3), FakeTransfer(1, fails=True), FakeTransfer(None)

        def refused():
            raise KVTransferError("posting failed")

        futures = [reads.read(lambda: done, 5.0), reads.read(lambda: failed, 5.0), reads.read(lambda: late, 0.05),
                   reads.read(refused, 5.0)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        reads.close()
        return [*results, late.abandoned]

    ok, failed, late, refused, abandoned = asyncio.run(main())
    assert ok is None
    assert isinstance(failed, KVTransferError) and "went away" in str(failed)
    assert isinstance(late, KVTransferError) and "timed out" in str(late) and abandoned
    assert isinstance(refused, KVTransferError) and "posting" in str(refused)


def test_closing_ends_the_reads_in_flight():
    async def main() -> None:
        reads = ReadThread()
        stuck = FakeTransfer(None)
        future = reads.read(lambda: stuck, 60.0)
        await asyncio.sleep(0.01)
        reads.close()
        with pytest.raises(KVTransferError, match="shutting down"):
            await asyncio.wait_for(future, 5)
        assert stuck.abandoned

    asyncio.run(main())
