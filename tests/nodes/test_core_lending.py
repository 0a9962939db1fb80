"""node.core_lending's two sides on one shared file: the borrower runs on the lender's cores too
(its stepping thread's affinity and torch's thread count) exactly while the lender says it is
idle, its cores were found free of other processes' work, and its own next step has no prompt to
prefill; a borrowed step that did not get its cores sends it back to its own for a back-off.

The affinity itself is checked in a child process (pytest's own affinity and threads stay as
they are); the decisions in-process, with the switch, the clock, /proc and the CPU time faked."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine.cpu_quota import read_core_times
from node import core_lending
from node.core_lending import Borrower, Lender

CHILD = textwrap.dedent("""
    import os, sys, torch
    from node.core_lending import Borrower, Lender
    own, lent, path = {int(sys.argv[1])}, {int(sys.argv[2])}, sys.argv[3]
    os.sched_setaffinity(0, own)
    torch.set_num_threads(1)
    ticks = iter(range(0, 10**6, 20))  # the lent core: idle (0 busy of 20 ticks a window)
    now = iter(x * 0.25 for x in range(10**6))
    lender = Lender(path)
    borrower = Borrower(path, lent, clock=lambda: next(now), core_times=lambda cores, pid: (0, next(ticks)))
    seen = []
    for busy, prefilling in ((True, False), (False, False), (False, False), (False, False), (True, False),
                             (False, False), (False, True), (True, True), (False, False)):
        lender.tell(busy)
        borrower.update(prefilling=prefilling)
        seen.append((sorted(os.sched_getaffinity(0)), torch.get_num_threads(), borrower.is_borrowing))
    print(seen, borrower.num_switches)
""")


def test_the_borrower_follows_the_lenders_flag_and_its_own_prompts(tmp_path):
    assert len(os.sched_getaffinity(0)) >= 2, "lending needs two cores (CI has two)"
    own, lent = sorted(os.sched_getaffinity(0))[:2]
    flag = tmp_path / "flag"
    flag.write_bytes(b"\x01")  # as pdserve.cores makes it: busy
    done = subprocess.run([sys.executable, "-c", CHILD, str(own), str(lent), str(flag)], capture_output=True,
                          text=True, timeout=120, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    alone, both = ([own], 1, False), ([own, lent], 2, True)
    # The first idle update opens a window on the lent core, the second reads it (free) and borrows.
    assert done.stdout.strip() == f"{[alone, alone, both, both, alone, both, alone, alone, both]} 5"


class Host:
    """A fake clock, /proc and process CPU time, and a borrower that only records its switches."""

    def __init__(self, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 100.0
        self.lent_busy = self.lent_total = 0  # the lent cores' ticks, the lender's own included
        self.lender_ticks = 0
        self.cpu = 0.0
        flag = tmp_path / "flag"
        flag.write_bytes(b"\x01")  # as pdserve.cores makes it: busy
        self.lender = Lender(flag)
        switched: list[bool] = []
        monkeypatch.setattr(Borrower, "_switch", lambda b, borrow: (switched.append(borrow),
                                                                   setattr(b, "is_borrowing", borrow)))
        self.switched = switched
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # one own core, whatever this host has
        self.borrower = Borrower(flag, {99}, clock=lambda: self.now, core_times=self._core_times,
                                 cpu_time=lambda: self.cpu)
        self.lenders_read: list[int] = []

    def _core_times(self, cores: set[int], pid: int) -> tuple[int, int]:
        assert cores == {99}
        self.lenders_read.append(pid)
        return self.lent_busy - self.lender_ticks, self.lent_total

    def idle_for(self, seconds: float, *, foreign_share: float = 0.0, lender_share: float = 0.0,
                 prefilling: bool = False) -> None:
        """The lender idle for seconds (updates every 50 ms), its cores busy foreign_share of the
        time with another process's work and lender_share with its own."""
        self.lender.tell(False)
        for _ in range(round(seconds / 0.05)):
            self.now += 0.05
            self.lent_total += 5
            self.lent_busy += round(5 * (foreign_share + lender_share))
            self.lender_ticks += round(5 * lender_share)
            self.borrower.update(prefilling=prefilling)

    def step(self, seconds: float, cpu_share: float) -> None:
        """A step whose threads (one per core it runs on) got cpu_share of their cores."""
        threads = len(self.borrower._all if self.borrower.is_borrowing else self.borrower._own)
        with self.borrower.step():
            self.now += seconds
            self.cpu += seconds * threads * cpu_share


@pytest.fixture
def host(tmp_path, monkeypatch):
    fake = Host(tmp_path, monkeypatch)
    yield fake
    fake.lender.close()
    fake.borrower.close()


def test_borrows_only_once_a_window_found_the_lenders_cores_free(host):
    host.idle_for(0.15)
    assert not host.borrower.is_borrowing and not host.borrower.cores_free  # no window read yet
    host.idle_for(0.15)
    assert host.borrower.is_borrowing and host.borrower.cores_free


def test_another_process_on_the_lenders_cores_keeps_the_borrower_off_them(host):
    host.idle_for(2.0, foreign_share=0.9)
    assert host.switched == [] and not host.borrower.cores_free
    host.idle_for(0.5)  # that process ended
    assert host.switched == [True]


def test_the_lenders_own_cpu_time_there_is_not_another_process(host):
    host.idle_for(1.0, lender_share=0.9)  # the lender's threads after its last step (replies, KV reads)
    assert host.switched == [True]


def test_a_window_needs_the_lender_idle_and_the_borrower_off_its_cores(host):
    host.idle_for(0.3)
    assert host.borrower.is_borrowing
    host.lender.tell(True)
    host.borrower.update(prefilling=False)
    assert not host.borrower.is_borrowing
    # The lender's busy spell does not count against its cores, and the last verdict stands.
    host.now += 2.0
    host.lent_busy += 200
    host.lent_total += 200
    host.idle_for(0.05)
    assert host.borrower.is_borrowing
    # Past the verdict's lifetime, the borrower waits for a new window.
    host.lender.tell(True)
    host.borrower.update(prefilling=False)
    host.now += core_lending._VERDICT_TTL_S + 1
    host.idle_for(0.05)
    assert not host.borrower.is_borrowing
    host.idle_for(0.25)
    assert host.borrower.is_borrowing


def spans(host, count: int, cpu_share: float) -> None:
    """count judged spans of borrowed steps (4 steps of a quarter of a span each)."""
    for _ in range(4 * count):
        host.step(core_lending._JUDGE_SPAN_S / 4 + 1e-6, cpu_share)  # the clock sums to a span, at least


def test_preempted_borrowed_steps_back_off_and_the_back_off_doubles(host):
    host.idle_for(0.3)
    host.step(0.1, cpu_share=0.3)  # the first after a switch is not judged: its threads wake up in it
    spans(host, 1, cpu_share=0.99)
    assert host.borrower.is_borrowing and host.borrower.num_preempted_steps == 0
    spans(host, 1, cpu_share=0.6)  # a thread waited for its core
    assert not host.borrower.is_borrowing and host.borrower.num_preempted_steps == 4
    host.idle_for(0.9)
    assert not host.borrower.is_borrowing  # within the first back-off (1 s)
    host.idle_for(0.3)
    assert host.borrower.is_borrowing
    host.step(0.1, cpu_share=0.3)
    assert host.borrower.is_borrowing  # again the first after the switch
    spans(host, 1, cpu_share=0.5)
    host.idle_for(1.5)
    assert not host.borrower.is_borrowing  # the second back-off is 2 s
    host.idle_for(0.7)
    assert host.borrower.is_borrowing
    host.step(0.1, cpu_share=0.95)
    spans(host, 1, cpu_share=0.95)  # good steps: the next back-off is 1 s again
    spans(host, 1, cpu_share=0.5)
    host.idle_for(1.3)
    assert host.borrower.is_borrowing


def test_steps_are_judged_over_a_span_and_not_on_its_own_cores(host):
    host.step(1.0, cpu_share=0.3)  # not borrowing
    host.idle_for(0.3)
    host.step(0.1, cpu_share=0.99)
    # One short step that did not get its cores, in a span that did: the span stands.
    host.step(core_lending._JUDGE_SPAN_S / 4, cpu_share=0.55)
    host.step(core_lending._JUDGE_SPAN_S * 3 / 4 + 1e-6, cpu_share=0.95)
    assert host.borrower.is_borrowing and host.borrower.num_preempted_steps == 0


def test_borrowing_pays_where_the_slowest_thread_still_wins_over_the_own_cores():
    # One own core and one lent: a lent thread must get 55% of its core (a step waits for it), which
    # makes the process's share (1 + 0.55) / 2; the measured break-even was 0.78.
    assert core_lending.lent_share_needed(1, 1) == pytest.approx(0.55)
    assert core_lending.min_cpu_share(1, 1) == pytest.approx(0.775)
    # Few lent cores beside many own ones must be nearly free; many lent beside one, less so.
    assert core_lending.lent_share_needed(3, 1) == pytest.approx(0.825)
    assert core_lending.lent_share_needed(1, 3) == pytest.approx(0.275)
    assert core_lending.lent_share_needed(10, 1) == 1.0


@pytest.mark.parametrize(("cpu_share", "borrowing"), [(0.80, True), (0.74, False)])
def test_the_judged_share_is_the_break_even_one(host, cpu_share, borrowing):
    host.idle_for(0.3)
    host.step(0.1, cpu_share=0.99)
    spans(host, 1, cpu_share=cpu_share)  # a proxy's replies beside a borrowed step: it still pays
    assert host.borrower.is_borrowing is borrowing


@pytest.mark.parametrize(("foreign_share", "borrowing"), [(0.4, True), (0.6, False)])
def test_the_window_asks_the_lent_share_of_the_cores_free(host, foreign_share, borrowing):
    host.idle_for(0.5, foreign_share=foreign_share)
    assert host.borrower.is_borrowing is borrowing


def test_a_restarted_lender_starts_a_new_window(host, tmp_path):
    host.idle_for(0.15)
    assert set(host.lenders_read) == {os.getpid()}  # the lender's process id, from the shared file
    host.lender.close()
    host.lender = Lender(tmp_path / "flag")  # what a new lender process writes (faked: another id)
    host.lender._map[core_lending._PID] = (os.getpid() + 1).to_bytes(8, "little")
    host.idle_for(0.2)  # the first window would have been read by now
    assert not host.borrower.is_borrowing and host.lenders_read[-1] == os.getpid() + 1
    host.idle_for(0.2)
    assert host.borrower.is_borrowing


def test_core_times_are_the_cores_ticks_less_the_lenders(tmp_path):
    (tmp_path / "stat").write_text(
        "cpu  10 0 10 100 0 0 0 0 0 0\n"
        "cpu0 1 2 3 40 4 0 0 0 0 0\n"      # busy 6 of 50 (idle 40, iowait 4)
        "cpu1 10 0 10 70 0 1 1 0 0 0\n"    # busy 22 of 92
        "intr 12345\n")
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text("77 (python3 (x)) S " + " ".join(["0"] * 10) + " 5 3 " + " ".join(["0"] * 30))
    assert read_core_times({0, 1}, 0, str(tmp_path)) == (28, 142)
    assert read_core_times({0, 1}, 77, str(tmp_path)) == (20, 142)
    assert read_core_times({0, 2}, 0, str(tmp_path)) is None  # a core /proc/stat does not list
    assert read_core_times({0}, 78, str(tmp_path)) is None  # the lender is gone
    assert read_core_times({0}, 0, str(tmp_path / "nowhere")) is None
