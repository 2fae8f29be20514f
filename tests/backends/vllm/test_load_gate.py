"""LoadGate: a weight load holds new requests back, sees whether any is in the engine, and an
abort reaches a request waiting at the gate."""

from __future__ import annotations

import asyncio

from rlinfer_vllm.load_gate import LoadGate


def test_held_gate_reports_idle_and_holds_new_requests() -> None:
    async def main() -> list[str]:
        gate = LoadGate()
        order: list[str] = []

        async def request() -> None:
            async with gate.enter("r1") as entry:
                assert entry.admitted
                order.append("request in engine")

        async with gate.held() as idle:
            assert idle
            task = asyncio.create_task(request())
            await asyncio.sleep(0.01)
            assert not task.done()  # premise: it waits while the load holds the gate
            order.append("load")
        await task
        return order

    assert asyncio.run(main()) == ["load", "request in engine"]


def test_busy_engine_is_not_idle_until_the_request_is_done() -> None:
    async def main() -> tuple[bool, bool, bool]:
        gate = LoadGate()
        async with gate.enter("r1") as entry:
            async with gate.held() as idle_while_running:
                pass
            entry.done()  # the engine finished it; a slow consumer still holds the block
            async with gate.held() as idle_after_done:
                pass
        async with gate.held() as idle_after_exit:
            pass
        return idle_while_running, idle_after_done, idle_after_exit

    assert asyncio.run(main()) == (False, True, True)


def test_abort_reaches_a_request_waiting_at_the_gate() -> None:
    async def main() -> tuple[bool, bool]:
        gate = LoadGate()
        admitted: list[bool] = []

        async def request(rid: str) -> None:
            async with gate.enter(rid) as entry:
                admitted.append(entry.admitted)

        async with gate.held():
            task = asyncio.create_task(request("r1"))
            await asyncio.sleep(0.01)
            gate.abort_waiting(["r1", "not-waiting"])
        await task
        async with gate.enter("r1") as again:  # the abort applied to that wait only
            pass
        return admitted[0], again.admitted

    assert asyncio.run(main()) == (False, True)


def test_cache_is_stale_after_requests_and_while_they_run() -> None:
    async def main() -> list[bool]:
        gate = LoadGate()
        seen = [gate.cache_stale]  # nothing known at start
        gate.cache_was_reset()
        seen.append(gate.cache_stale)  # reset while idle: clean
        async with gate.enter("r1"):
            gate.cache_was_reset()  # a reset while r1 runs: r1 keeps adding blocks
            seen.append(gate.cache_stale)
        seen.append(gate.cache_stale)  # r1 ran since the reset
        gate.cache_was_reset()
        seen.append(gate.cache_stale)
        return seen

    assert asyncio.run(main()) == [True, False, True, True, False]
