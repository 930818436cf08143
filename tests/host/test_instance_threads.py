"""InstanceThreads: each target on a thread of its own, idle threads reused, bounded and closed."""
from __future__ import annotations

import threading
import time
import weakref

import pytest

from host.sandbox.instance_threads import IDLE_NAME, InstanceThreads


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_and_record(pool: InstanceThreads, name: str, release: threading.Event | None = None
                   ) -> dict:
    """Run a target that records its thread (and waits for `release`); returns the record once
    the target has started."""
    record: dict = {}
    started = threading.Event()

    def target() -> None:
        record["ident"] = threading.get_ident()
        record["thread"] = threading.current_thread()
        record["name"] = record["thread"].name
        started.set()
        if release is not None:
            release.wait(5)
        record["done"] = True

    pool.run(target, name)
    assert started.wait(5)
    return record


def test_spare_threads_are_started_with_the_pool():
    pool = InstanceThreads(num_spare=3, max_idle=8)
    assert wait_until(lambda: pool.num_idle == 3)
    pool.close()
    assert wait_until(lambda: pool.num_idle == 0)


def test_targets_run_at_once_each_on_a_thread_of_its_own_named_after_it():
    pool = InstanceThreads(num_spare=1, max_idle=8)
    release = threading.Event()
    records = [run_and_record(pool, f"pie-{i}", release) for i in range(4)]   # all 4 block
    assert len({record["ident"] for record in records}) == 4
    assert [record["name"] for record in records] == [f"pie-{i}" for i in range(4)]
    release.set()
    assert wait_until(lambda: all(record.get("done") for record in records))
    pool.close()


def test_a_thread_whose_target_ended_runs_the_next_one_and_idles_unnamed():
    pool = InstanceThreads(num_spare=0, max_idle=8)
    first = run_and_record(pool, "pie-first")
    assert wait_until(lambda: pool.num_idle == 1)
    idle_names = {t.name for t in threading.enumerate() if t.ident == first["ident"]}
    assert idle_names == {IDLE_NAME}
    second = run_and_record(pool, "pie-second")
    assert second["ident"] == first["ident"] and second["name"] == "pie-second"
    pool.close()


def test_at_most_max_idle_threads_wait_and_each_at_most_idle_s():
    pool = InstanceThreads(num_spare=0, max_idle=2, idle_s=0.3)
    release = threading.Event()
    records = [run_and_record(pool, f"pie-{i}", release) for i in range(5)]
    release.set()
    assert wait_until(lambda: all(record.get("done") for record in records))
    time.sleep(0.05)
    assert pool.num_idle == 2                       # the other three threads have exited
    assert wait_until(lambda: pool.num_idle == 0)   # idle_s passed: they exit too
    pool.close()


def test_a_target_that_raises_leaves_the_thread_serving_the_pool(caplog):
    pool = InstanceThreads(num_spare=0, max_idle=4)

    def broken() -> None:
        raise ValueError("broken target")

    pool.run(broken, "pie-broken")
    assert wait_until(lambda: pool.num_idle == 1)
    assert "its target raised" in caplog.text
    assert run_and_record(pool, "pie-after")["name"] == "pie-after"
    pool.close()


def test_closing_ends_the_idle_threads_and_later_targets_still_run_on_threads_that_exit():
    others = set(threading.enumerate())               # other pools' threads among them
    pool = InstanceThreads(num_spare=2, max_idle=4)
    assert wait_until(lambda: pool.num_idle == 2)
    threads = {t for t in threading.enumerate() if t.name == IDLE_NAME} - others
    assert len(threads) == 2
    pool.close()
    assert wait_until(lambda: not any(thread.is_alive() for thread in threads))
    late = run_and_record(pool, "pie-late")
    assert late["name"] == "pie-late"
    assert wait_until(lambda: late.get("done") and not late["thread"].is_alive())
    assert pool.num_idle == 0


@pytest.mark.parametrize("num_spare, max_idle, idle_s", [(3, 2, 1.0), (-1, 2, 1.0), (0, 2, 0)])
def test_sizes_are_validated(num_spare, max_idle, idle_s):
    with pytest.raises(ValueError, match="InstanceThreads"):
        InstanceThreads(num_spare, max_idle, idle_s)


def test_a_pool_thread_keeps_nothing_of_a_target_it_ran():
    """The first target of a new thread too (a Thread's args live as long as the thread)."""
    pool = InstanceThreads(num_spare=0, max_idle=8)

    class Payload:
        pass

    for _ in range(2):                    # on a new thread, then on the idle one
        payload = Payload()
        ran = threading.Event()
        pool.run(lambda payload=payload: ran.set(), "pie-payload")
        assert ran.wait(5)
        kept = weakref.ref(payload)
        del payload
        assert wait_until(lambda: kept() is None and pool.num_idle == 1)
    pool.close()
