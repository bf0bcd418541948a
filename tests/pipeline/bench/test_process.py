"""Reading a process from /proc (pipeline/bench/process.py): its CPU time, one thread's, and
its children."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from pipeline.bench.process import child_pids, cpu_seconds


def test_a_threads_cpu_time_is_part_of_its_process_and_no_process_has_none() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        stop.wait(0.3)
        whole, main = cpu_seconds(os.getpid()), cpu_seconds(os.getpid(), thread=os.getpid())
        assert spinner.native_id is not None
        other = cpu_seconds(os.getpid(), thread=spinner.native_id)
    finally:
        stop.set()
        spinner.join()
    assert whole is not None and main is not None and other is not None
    assert other > 0 and main + other <= whole + 0.05
    # above Linux's largest pid (2**22)
    assert cpu_seconds(2**22 + 7) is None and child_pids(2**22 + 7) == []


def test_the_children_of_a_process_are_the_processes_it_started() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in child_pids(os.getpid())
        assert child_pids(child.pid) == []
    finally:
        child.kill()
        child.wait()
    assert child.pid not in child_pids(os.getpid())
