"""`GroupCommit`: writes applied by one worker thread, many per transaction.

With a linger (the message history's), writes nobody waits for gather into
one batch, and a `commit` ends the wait at once. No timing is asserted: the
linger is made far longer than any test, so a test that passes did not sit it
out, and one that would is cut off by `HANG_S`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from geofed.node._store import GroupCommit

LONG_LINGER_S = 3600.0
HANG_S = 60.0


def _applied() -> tuple[list[list[int]], GroupCommit[int], ThreadPoolExecutor]:
    batches: list[list[int]] = []
    executor = ThreadPoolExecutor(max_workers=1)
    writes = GroupCommit(executor, batches.append, "test", linger_s=LONG_LINGER_S)
    return batches, writes, executor


def test_writes_nobody_waits_for_gather_and_a_commit_ends_the_linger() -> None:
    async def run() -> list[list[int]]:
        batches, writes, executor = _applied()
        try:
            for n in range(5):
                writes.write(n)
                await asyncio.sleep(0)  # the flusher runs between writes, and lingers
            assert batches == [] and writes.dirty
            await asyncio.wait_for(writes.commit(), HANG_S)
            return batches
        finally:
            executor.shutdown()

    assert asyncio.run(run()) == [[0, 1, 2, 3, 4]]


def test_without_a_linger_each_write_is_applied_without_a_commit() -> None:
    async def run() -> list[list[int]]:
        batches: list[list[int]] = []
        with ThreadPoolExecutor(max_workers=1) as executor:
            writes = GroupCommit(executor, batches.append, "test")
            writes.write(1)
            while writes.dirty or not batches:
                await asyncio.sleep(0.01)  # applied by the flusher on its own
            await writes.commit()
        return batches

    assert asyncio.run(run()) == [[1]]
