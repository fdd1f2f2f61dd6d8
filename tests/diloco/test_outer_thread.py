"""The master's outer thread on its own (no store): it outlives a bad turn, ends on a lost
lease with the failure recorded and the lease told, and the optional store capabilities are
found as components (``members``, ``side_files``) or not at all."""

from __future__ import annotations

import threading
from pathlib import Path

from diloco_fakes import MemoryTransport, wait_for

from speedtronic_diloco.master.outer_thread import OuterThread
from speedtronic_diloco.transports.base import LeaseLostError
from speedtronic_diloco.transports.members import MemberRecords, member_records_of
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport
from speedtronic_diloco.transports.side_files import SideFiles, side_files_of


class Lease:
    """A lease keeper that can be lost on demand and records what it was told."""

    failover = False

    def __init__(self) -> None:
        self.lost = threading.Event()
        self.told: list[str] = []

    def check(self) -> None:
        if self.lost.is_set():
            raise LeaseLostError("another master holds the lease")

    def mark_lost(self, why: str) -> None:
        self.told.append(why)


def test_a_turn_that_fails_is_logged_and_the_thread_goes_on() -> None:
    turns: list[int] = []

    def turn(stop: threading.Event) -> None:
        turns.append(len(turns))
        if len(turns) == 1:
            raise RuntimeError("one bad round")

    thread = OuterThread(turn, lambda: None)
    thread.start(0.01)
    try:
        wait_for(lambda: len(turns) >= 3, what="three turns, the first of them failed")
        assert thread.running and thread.failure is None
    finally:
        assert thread.stop(10.0)
    assert not thread.running


def test_wake_runs_the_next_turn_now_instead_of_after_the_interval() -> None:
    turns: list[int] = []
    thread = OuterThread(lambda stop: turns.append(1), lambda: None)
    thread.start(3600.0)  # without wake() a second turn would come in an hour
    try:
        wait_for(lambda: len(turns) >= 1, what="the first turn")
        thread.wake()
        wait_for(lambda: len(turns) >= 2, what="a turn right after wake()")
        thread.wake()
        wait_for(lambda: len(turns) >= 3, what="another turn after the next wake()")
    finally:
        assert thread.stop(10.0)  # stop() also ends the hour-long wait at once
    assert not thread.running


def test_a_lost_lease_ends_the_thread_with_the_failure_and_tells_the_lease() -> None:
    lease = Lease()
    turns: list[int] = []
    thread = OuterThread(lambda stop: turns.append(1), lambda: lease)
    thread.start(0.01)
    wait_for(lambda: len(turns) >= 1, what="a first turn")
    lease.lost.set()
    wait_for(lambda: not thread.running, what="the thread to end")
    assert isinstance(thread.failure, LeaseLostError)
    assert lease.told == ["another master holds the lease"]
    count = len(turns)
    thread.stop(1.0)
    assert len(turns) == count  # no turn after the lease was lost


def test_stop_before_start_and_twice_is_harmless() -> None:
    thread = OuterThread(lambda stop: None, lambda: None)
    assert thread.stop(0.1) and not thread.running
    thread.start(0.01)
    assert thread.stop(10.0) and thread.stop(10.0)


def test_the_optional_capabilities_are_components_or_none(tmp_path: Path) -> None:
    shared = SharedDirectoryTransport(tmp_path / "store")
    assert isinstance(member_records_of(shared), MemberRecords)
    assert isinstance(side_files_of(shared), SideFiles)
    assert member_records_of(shared) is shared.members
    assert side_files_of(shared) is shared.side_files
    bare = MemoryTransport()
    assert member_records_of(bare) is None and side_files_of(bare) is None
    bare.members = object()  # type: ignore[attr-defined]  # not a MemberRecords
    assert member_records_of(bare) is None
