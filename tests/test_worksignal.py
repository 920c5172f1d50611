"""hub/domain/worksignal.py: which long-polls a change wakes, and that no wake-up is lost."""

from __future__ import annotations

import asyncio

from gpuflex.hub.domain.worksignal import MISSES, Wake, WorkSignal, pass_on


async def _waiting(sig: WorkSignal, *nodes: str, within: float = 5.0) -> list[asyncio.Task[Wake]]:
    tasks = []
    for n in nodes:
        tasks.append(asyncio.create_task(sig.wait(n, within)))
        await asyncio.sleep(0)  # registered in this order
    assert len(sig) == len(nodes)
    return tasks


async def test_notify_wakes_every_poll_and_close_wakes_them_for_good() -> None:
    sig = WorkSignal()
    tasks = await _waiting(sig, "a", "b", "c")
    sig.notify()
    assert [w.kind for w in await asyncio.gather(*tasks)] == ["all"] * 3
    assert len(sig) == 0
    sig.close()
    assert (await sig.wait("a", 5.0)).kind == "all"  # a poll after close does not wait


async def test_an_offer_wakes_the_longest_waiting_poll_only() -> None:
    sig = WorkSignal()
    a, b, c = await _waiting(sig, "a", "b", "c")
    assert sig.offer(misses=1)
    assert (await a) == Wake("offer", 1)
    await asyncio.sleep(0.01)
    assert not b.done() and not c.done() and len(sig) == 2
    sig.offer()
    assert (await b).kind == "offer" and not c.done()
    sig.notify()
    await c
    assert not sig.offer()  # nobody waits: nothing to wake


async def test_for_node_wakes_that_nodes_polls_only() -> None:
    sig = WorkSignal()
    a, b = await _waiting(sig, "a", "b")
    sig.for_node("b")
    assert (await b).kind == "node"
    await asyncio.sleep(0.01)
    assert not a.done()
    sig.notify()
    await a


async def test_a_change_between_plan_and_wait_is_not_lost() -> None:
    sig = WorkSignal()
    since = sig.generation  # the poll reads the generation, then plans (and finds nothing)
    sig.offer()  # ... meanwhile work appears, with nobody waiting yet
    assert (await sig.wait("a", 5.0, since)).kind == "moved"  # it plans again at once
    assert (await sig.wait("a", 0.05, sig.generation)).kind == "timeout"


async def test_a_timed_out_poll_leaves_the_queue_and_an_offer_goes_to_the_next() -> None:
    sig = WorkSignal()
    short = asyncio.create_task(sig.wait("a", 0.05))
    await asyncio.sleep(0)
    long_ = asyncio.create_task(sig.wait("b", 5.0))
    await asyncio.sleep(0)
    assert (await short).kind == "timeout"
    assert len(sig) == 1
    sig.offer()
    assert (await long_).kind == "offer"


async def test_an_offer_a_cancelled_poll_got_is_passed_on() -> None:
    sig = WorkSignal()
    a, b = await _waiting(sig, "a", "b")
    sig.offer()
    a.cancel()  # the client hung up right after its offer arrived
    try:
        await a
    except asyncio.CancelledError:
        pass
    assert (await asyncio.wait_for(b, 1.0)).kind == "offer"


def test_pass_on_travels_while_polls_get_work_and_stops_after_misses_in_a_row() -> None:
    assert pass_on(Wake("all"), got_work=False) is None and pass_on(Wake("timeout"), got_work=True) is None
    assert pass_on(Wake("offer", MISSES - 1), got_work=True) == 0  # work taken: more may be left
    misses = 0
    for _ in range(MISSES - 1):
        nxt = pass_on(Wake("offer", misses), got_work=False)
        assert nxt == misses + 1
        misses = nxt
    assert pass_on(Wake("offer", misses), got_work=False) is None


async def test_a_returned_shard_wakes_one_waiting_node_not_all(tmp_path) -> None:
    """On a real hub: twelve nodes wait in long-polls; the one shard goes back to the pool; one of
    them gets it at once, and the offer wakes 1 + MISSES polls, not twelve."""
    import time

    import aiohttp
    from gpuflex.hub.server.appkeys import LEDGER
    from gpuflex.protocol.messages import Assignment

    from tests.helpers import SimNode, start_hub, submit_job, write_digits

    train, val, spec = write_digits(tmp_path / "d", rounds=1, chunk_size=4096, replication="0.0")
    hub = await start_hub(tmp_path / "hub", long_poll_max_s=20.0)
    try:
        async with aiohttp.ClientSession() as s:
            assert (await submit_job(s, hub, spec, train, val)).status == 201
            holder = SimNode(s, hub.url)
            await holder.register()
            a = await holder.work(2.0)
            assert isinstance(a, Assignment)
            waiters = [SimNode(s, hub.url) for _ in range(12)]
            for w in waiters:
                await w.register()
            polls = [asyncio.create_task(w.work(15.0)) for w in waiters]
            signal = hub.app[LEDGER].signal
            deadline = time.monotonic() + 10
            while len(signal) < len(waiters):
                assert time.monotonic() < deadline, len(signal)
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            assert (await holder.abandon(a.assignment_id)).status == 200
            await asyncio.wait(polls, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
            took = time.monotonic() - t0
            await asyncio.sleep(0.3)  # the offer travels on and stops
            got = [t.result() for t in polls if t.done()]
            assert [type(g) for g in got] == [Assignment] and took < 2.0
            assert got[0].chunks == a.chunks  # the returned shard
            assert len(signal) == len(waiters) - 1  # the others wait on (those the offer passed went back)
            async with s.get(hub.url + "/metrics") as r:
                text = await r.text()
            assert f'gpuflex_poll_wakeups_total{{kind="offer"}} {1 + MISSES}' in text
            assert 'kind="all"' not in text
            for t in polls:
                t.cancel()
            await asyncio.gather(*polls, return_exceptions=True)
    finally:
        await hub.stop()


async def test_a_directed_offer_wakes_the_longest_waiting_poll_it_accepts() -> None:
    """A wanted replica is offered to the nodes that may take it (not a member, not its block)."""
    sig = WorkSignal()
    a, b, c = await _waiting(sig, "member", "other-block", "eligible")
    accepts = {"eligible", "other-block"}.__contains__
    assert sig.offer(to=accepts)
    woken = await b  # "member" has waited longer but may not take it
    assert woken.kind == "offer" and woken.to is accepts
    assert not a.done() and not c.done()
    # b found nothing after all (a race): the offer goes on to the next accepted poll
    assert pass_on(woken, got_work=False) == 1
    assert sig.offer(1, woken.to)
    assert (await c).kind == "offer" and not a.done()
    # a directed offer that placed its one piece of work stops there
    assert pass_on(Wake("offer", 0, accepts), got_work=True) is None
    assert not sig.offer(to=lambda _nid: False)  # nobody it accepts waits
    sig.notify()
    await a
