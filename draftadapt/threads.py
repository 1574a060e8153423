"""Work beside the caller, each job in a thread of its own that ends with the job.

    jobs = JobThreads("draftadapt-publish")
    done = jobs.submit(write, version)   # a concurrent.futures.Future
    done.result()
    jobs.shutdown()

Why not a ``ThreadPoolExecutor``: on a CPU, a thread that has run torch operations keeps an
OpenMP team of its own for as long as it lives, and in a process with vLLM's CPU engine that idle
team slowed everything after it. Measured here (AMD EPYC, 2 cores; ``python
scripts/bench_job_threads.py``): after one ``torch.save`` in a pool's thread that stayed alive, the
engine's generation took ~1.5x as long for the rest of the process; in the demo, every RL step
after the adapter's first background publish took 1.5x as long (generation 1.7x, the policy update
1.3x). The same work in a thread that had ended left both as they were (docs/design.md,
"Publishing beside the next round"). Jobs run one at a time, in the order submitted: a submit
first joins the thread before it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable


class JobThreads:
    """``submit(fn, *args)`` runs ``fn`` in a new thread named ``name`` and returns its Future;
    the thread ends when ``fn`` returns or raises. The drop-in for ``ThreadPoolExecutor(max_workers=1)``
    where the jobs run torch operations beside a CPU engine."""

    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._count = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        self.join()  # one job at a time, as a one-worker pool runs them
        future: Future = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args)
            except BaseException as exc:  # the caller sees it through the Future, as from a pool
                future.set_exception(exc)
            else:
                future.set_result(result)

        self._count += 1
        self._thread = threading.Thread(target=run, name=f"{self.name}-{self._count}")
        self._thread.start()
        return future

    def join(self) -> None:
        """Until the last job's thread has ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def shutdown(self, wait: bool = True) -> None:
        if wait:
            self.join()
