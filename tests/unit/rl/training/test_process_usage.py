"""A step's row logs the page faults and system time of the step (rl/training/step.py ProcessUsage): memory the
process touches for the first time shows there."""

from __future__ import annotations

import mmap

from rlrunbook.rl.training.step import ProcessUsage

PAGES = 4096


def test_pages_touched_for_the_first_time_are_counted_as_faults():
    before = ProcessUsage.now()
    fresh = mmap.mmap(-1, PAGES * mmap.PAGESIZE)  # anonymous memory no page of which is backed yet
    for page in range(PAGES):
        fresh[page * mmap.PAGESIZE] = 1
    grown = before.since()
    fresh.close()
    assert grown["memory/minor_faults"] >= PAGES
    assert grown["time/system_cpu_s"] >= 0.0


def test_memory_touched_again_is_not_counted():
    fresh = mmap.mmap(-1, PAGES * mmap.PAGESIZE)
    for page in range(PAGES):
        fresh[page * mmap.PAGESIZE] = 1
    before = ProcessUsage.now()
    for page in range(PAGES):
        fresh[page * mmap.PAGESIZE] = 2
    grown = before.since()
    fresh.close()
    assert grown["memory/minor_faults"] < PAGES // 8
