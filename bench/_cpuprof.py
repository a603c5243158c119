"""Run ``python -m proxy`` under cProfile with a CPU-time clock (``bench.perreq --cprofile``):
on a shared machine a wall clock would charge other processes' turns to whatever line ran."""

from __future__ import annotations

import cProfile
import runpy
import sys
import time

if __name__ == "__main__":
    out, sys.argv = sys.argv[1], ["proxy", *sys.argv[2:]]
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        runpy.run_module("proxy", run_name="__main__", alter_sys=True)
    finally:
        profiler.disable()
        profiler.dump_stats(out)
