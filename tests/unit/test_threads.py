"""draftadapt.threads.JobThreads: a thread per job, ended with it, one job at a time; results
and errors through the Future, as from a one-worker pool (the speed reason is measured by
scripts/bench_job_threads.py, not here)."""

from __future__ import annotations

import threading
import time

import pytest

from draftadapt.threads import JobThreads


def _alive(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_each_job_has_its_own_thread_that_ends_with_it():
    jobs = JobThreads("test-jobs")
    names = []
    first = jobs.submit(lambda x: names.append(threading.current_thread().name) or x * 2, 21)
    assert first.result(timeout=10) == 42
    second = jobs.submit(lambda: names.append(threading.current_thread().name) or "ok")
    assert second.result(timeout=10) == "ok"
    jobs.shutdown()
    assert names == ["test-jobs-1", "test-jobs-2"]  # two threads, not one reused
    assert _alive("test-jobs") == []  # nothing outlives its job


def test_jobs_run_one_at_a_time_in_order():
    jobs = JobThreads("test-order")
    log: list[tuple[str, int]] = []

    def job(i: int) -> None:
        log.append(("start", i))
        time.sleep(0.05)
        log.append(("end", i))

    futures = [jobs.submit(job, i) for i in range(3)]
    for f in futures:
        f.result(timeout=10)
    jobs.shutdown()
    assert log == [(e, i) for i in range(3) for e in ("start", "end")]


def test_an_error_reaches_the_caller_through_the_future():
    jobs = JobThreads("test-error")
    failed = jobs.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    assert isinstance(failed.exception(), ZeroDivisionError)
    assert jobs.submit(lambda: "next").result(timeout=10) == "next"  # the next job still runs
    jobs.shutdown()
    assert _alive("test-error") == []
