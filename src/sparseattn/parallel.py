"""Independent tasks spread over processes: the calling process plus ``workers - 1`` spawned ones.

The heavy builders (k-means in ``scipy.cluster.vq`` holds the GIL) scale poorly on threads, so
long analyses run their slices in separate processes. Child processes are *spawned* (a fresh
interpreter: no fork of a threaded process) and each uses one BLAS thread; the calling process
works on the same task list meanwhile, so the children's start-up overlaps useful work. If the
children cannot start or die, the calling process finishes their tasks itself.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import nullcontext

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional: without it BLAS keeps its own thread count
    threadpool_limits = None

_worker_blas_limit = None


def default_workers() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def single_threaded_blas():
    """Context manager: BLAS on one thread (a no-op without threadpoolctl)."""
    return threadpool_limits(1, user_api="blas") if threadpool_limits is not None else nullcontext()


def _init_worker() -> None:
    global _worker_blas_limit
    if threadpool_limits is not None:
        _worker_blas_limit = threadpool_limits(1, user_api="blas")


class _TaskQueue:
    """Task indices handed out in order; tasks lost with a broken child go back to the front."""

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.next = 0
        self.n = n
        self.returned: list[int] = []
        self.error: BaseException | None = None
        self.in_children = 0

    def take(self, for_child: bool) -> int | None:
        with self.cond:
            if self.error is not None:
                return None
            if self.returned:
                i = self.returned.pop()
            elif self.next < self.n:
                i, self.next = self.next, self.next + 1
            else:
                return None
            self.in_children += for_child
            return i

    def settle(self, i: int, error: BaseException | None = None, from_child: bool = True) -> None:
        with self.cond:
            if isinstance(error, BrokenProcessPool):
                self.returned.append(i)
            elif error is not None and self.error is None:
                self.error = error
            self.in_children -= from_child
            self.cond.notify_all()


def run_tasks(
    fn: Callable, tasks: Sequence, workers: int | None = None, on_done: Callable[[int], None] | None = None
) -> list:
    """``[fn(t) for t in tasks]`` on up to ``workers`` processes; results in task order.

    Tasks are handed out in order (put the longest first). ``fn`` and the tasks must pickle (``fn``
    a module-level function). ``on_done(i)`` runs after task ``i`` finishes, possibly on another
    thread. The first exception of a task is raised once the running tasks have stopped.
    """
    tasks = list(tasks)
    workers = min(default_workers() if workers is None else int(workers), len(tasks))
    results: list = [None] * len(tasks)
    queue = _TaskQueue(len(tasks))

    def finish(i: int, value) -> None:
        results[i] = value
        if on_done is not None:
            on_done(i)

    def work_here() -> None:
        with single_threaded_blas():
            while (i := queue.take(for_child=False)) is not None:
                finish(i, fn(tasks[i]))

    if workers <= 1:
        work_here()
        return results

    with ProcessPoolExecutor(
        workers - 1, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
    ) as pool:

        def submit_next() -> None:
            i = queue.take(for_child=True)
            if i is None:
                return
            try:
                future = pool.submit(fn, tasks[i])
            except (BrokenProcessPool, RuntimeError) as error:  # no child left: the caller takes it
                queue.settle(i, BrokenProcessPool(str(error)))
                return
            future.add_done_callback(lambda f, i=i: collect(i, f))

        def collect(i: int, future: Future) -> None:
            error = BrokenProcessPool("cancelled") if future.cancelled() else future.exception()
            try:
                if error is None:
                    finish(i, future.result())
                    submit_next()  # before settling: the count of tasks in children never drops to 0 early
            except BaseException as failure:  # noqa: BLE001 -- on_done failed: report it, stop handing out
                error = failure
            finally:
                queue.settle(i, error)

        for _ in range(workers - 1):
            submit_next()
        try:
            work_here()
            with queue.cond:  # wait for the children, then take back what a broken child lost
                queue.cond.wait_for(lambda: queue.in_children == 0)
            work_here()
        except BaseException as error:
            queue.settle(-1, error, from_child=False)
            with queue.cond:
                queue.cond.wait_for(lambda: queue.in_children == 0)
            raise
    if queue.error is not None:
        raise queue.error
    return results
