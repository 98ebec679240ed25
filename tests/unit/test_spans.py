"""Spans: what the hosts of one run tell each other about units over several hosts."""

from __future__ import annotations

import threading
import time

from dflashops.lifecycle.spans import Spans


def test_settle_waits_for_the_other_hosts_still_on_the_span_and_sees_their_failure() -> None:
    spans, abort = Spans(), threading.Event()
    spans.begin(["p/big"], "h0")
    spans.begin(["p/big"], "h1")

    def h1() -> None:
        time.sleep(0.3)
        spans.fail("p/big", "big-0 (rank 1 of 2) on h1: died while starting")
        spans.end(["p/big"], "h1")

    threading.Thread(target=h1).start()
    spans.end(["p/big"], "h0")
    t0 = time.monotonic()
    spans.settle(["p/big"], "h0", timeout=10, abort=abort)
    assert 0.2 < time.monotonic() - t0 < 5
    assert spans.failure("p/big") == "big-0 (rank 1 of 2) on h1: died while starting"
    spans.fail("p/big", "a later failure")  # the first one is what every host reports
    assert spans.failure("p/big") == "big-0 (rank 1 of 2) on h1: died while starting"
    assert spans.failure("p/other") is None and spans.failure(None) is None


def test_settle_never_waits_for_a_host_that_has_not_begun_and_gives_up_at_its_timeout() -> None:
    spans, abort = Spans(), threading.Event()
    spans.begin(["p/big"], "h0")
    t0 = time.monotonic()
    spans.settle(["p/big"], "h0", timeout=10, abort=abort)  # h1 never began (--forks)
    assert time.monotonic() - t0 < 0.5
    spans.begin(["p/big"], "h1")  # began, never ends (a stuck host)
    t0 = time.monotonic()
    spans.settle(["p/big"], "h0", timeout=0.5, abort=abort)
    assert 0.4 < time.monotonic() - t0 < 3


def test_meet_returns_once_every_host_on_the_span_has_arrived_or_on_ctrl_c() -> None:
    spans, abort = Spans(), threading.Event()
    spans.begin(["p/big"], "h0")
    spans.begin(["p/big"], "h1")
    arrived: list[float] = []

    def h0() -> None:
        spans.meet("p/big", "h0", timeout=10, abort=abort)
        arrived.append(time.monotonic())

    waiter = threading.Thread(target=h0)
    waiter.start()
    time.sleep(0.3)
    assert not arrived  # h1 has not come to the meeting yet
    t1 = time.monotonic()
    spans.meet("p/big", "h1", timeout=10, abort=abort)
    waiter.join(5)
    assert arrived and arrived[0] >= t1

    spans.begin(["p/late"], "h0")
    spans.begin(["p/late"], "h1")
    abort.set()
    t0 = time.monotonic()
    spans.meet("p/late", "h0", timeout=10, abort=abort)
    assert time.monotonic() - t0 < 0.5
