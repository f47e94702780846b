"""Dynamic batching: concurrent requests coalesce into one inference call.

Requests put their images on a queue and await a future. One worker task waits for the first request,
then until `max_batch_size` images wait or `max_delay` has passed since it arrived, runs the model on the
whole batch in a worker thread (the event loop keeps accepting requests meanwhile, so the next batch
fills while this one computes), then hands each request its rows. A bounded queue refuses work it could
not finish in time instead of letting latency grow without limit.

The queue is a deque and the worker sleeps on one future with one timer per batch (not a task and a
timer per request, as `asyncio.wait_for(queue.get())` would cost): at thousands of requests per second
the per-request cost of the event loop is what limits the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

Predict = Callable[[np.ndarray], np.ndarray]


class QueueFull(Exception):
    """More images are waiting than the server accepts; the client should retry later."""


class Draining(Exception):
    """The server is shutting down and takes no new work."""


@dataclass
class _Job:
    images: np.ndarray
    future: asyncio.Future[np.ndarray]
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """Hooks for metrics; the server wires them to Prometheus."""

    on_batch: Callable[[int, float], None] = lambda size, seconds: None
    on_queue: Callable[[int], None] = lambda depth: None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _expire(futures: list[asyncio.Future[np.ndarray]]) -> None:
    """A request's time is up: its jobs fail with TimeoutError (the worker skips them if still queued)."""
    for future in futures:
        if not future.done():
            future.set_exception(TimeoutError())


class DynamicBatcher:
    def __init__(
        self,
        predict: Predict,
        max_batch_size: int,
        max_delay_s: float,
        max_queue_images: int,
        stats: BatchStats | None = None,
    ) -> None:
        self._predict = predict
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self.max_queue_images = max_queue_images
        self._stats = stats or BatchStats()
        self._jobs: deque[_Job] = deque()
        self._queued_images = 0
        self._wakeup: asyncio.Future[None] | None = None  # the worker waits on it ...
        self._wake_at = 1  # ... until this many images are queued (or its timer fires)
        self._in_flight = 0
        self._draining = False
        self._worker: asyncio.Task[None] | None = None
        self._running: list[_Job] = []  # the batch being computed (failed too if the worker dies)
        # One inference thread: the runtime parallelises inside a batch; two batches at once would only
        # fight over the same cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")

    @property
    def queued_images(self) -> int:
        return self._queued_images

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    @property
    def alive(self) -> bool:
        """False once the worker task has ended (crashed): liveness then fails and the orchestrator restarts us."""
        return self._worker is not None and not self._worker.done()

    async def infer(self, images: np.ndarray, timeout_s: float | None = None) -> np.ndarray:
        """Model outputs for `images` [N, ...]; large requests are split into several batches. After `timeout_s`
        a TimeoutError: one timer handle, no context manager around the await."""
        if self._draining:
            raise Draining()
        if self._queued_images + len(images) > self.max_queue_images:
            raise QueueFull()
        loop = asyncio.get_running_loop()
        jobs = []
        for start in range(0, len(images), self.max_batch_size):
            chunk = images[start : start + self.max_batch_size]
            job = _Job(chunk, loop.create_future())
            jobs.append(job)
            self._queued_images += len(chunk)
            self._jobs.append(job)
        self._stats.on_queue(self._queued_images)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done() and self._queued_images >= self._wake_at:
            wakeup.set_result(None)
        self._in_flight += 1
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, [job.future for job in jobs])
        try:
            if len(jobs) == 1:
                return await jobs[0].future
            results = await asyncio.gather(*(job.future for job in jobs))
        finally:
            self._in_flight -= 1
            if timer is not None:
                timer.cancel()
        return np.concatenate(results)

    async def _wait(self, wake_at: int, timeout_s: float | None) -> None:
        """Sleep until `wake_at` images are queued or `timeout_s` has passed."""
        loop = asyncio.get_running_loop()
        self._wake_at = wake_at
        self._wakeup = waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _resolve, waiter)
        try:
            await waiter
        finally:
            self._wakeup = None
            if timer is not None:
                timer.cancel()

    async def _collect(self) -> list[_Job]:
        """The next batch: the first job, then whatever arrives within max_delay, up to max_batch_size."""
        while not self._jobs:
            await self._wait(1, None)
        deadline = self._jobs[0].enqueued + self.max_delay_s
        while self._queued_images < self.max_batch_size:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            await self._wait(self.max_batch_size, remaining)
        jobs = [self._jobs.popleft()]
        size = len(jobs[0].images)
        while self._jobs and size + len(self._jobs[0].images) <= self.max_batch_size:
            job = self._jobs.popleft()
            jobs.append(job)
            size += len(job.images)
        return jobs

    async def _run(self) -> None:
        try:
            await self._serve()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug in the loop itself: fail the waiting requests, let liveness fail
            stranded = [*self._running, *self._jobs]
            self._jobs.clear()
            for job in stranded:
                if not job.future.done():
                    job.future.set_exception(RuntimeError(f"the inference worker stopped: {type(exc).__name__}"))
            raise

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            live = [job for job in jobs if not job.future.done()]  # skip requests that timed out
            size = sum(len(job.images) for job in jobs)
            self._queued_images -= size
            self._stats.on_queue(self._queued_images)
            if not live:
                continue
            self._running = live
            batch = live[0].images if len(live) == 1 else np.concatenate([job.images for job in live])
            started = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._executor, self._predict, batch)
            except Exception as exc:  # the model failed: every waiting request gets the error
                for job in live:
                    if not job.future.done():
                        job.future.set_exception(exc)
                continue
            self._stats.on_batch(len(batch), time.perf_counter() - started)
            offset = 0
            for job in live:
                n = len(job.images)
                if not job.future.done():
                    job.future.set_result(outputs[offset : offset + n])
                offset += n

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work, let queued and running batches finish (up to timeout_s), then stop."""
        self._draining = True
        deadline = time.perf_counter() + timeout_s
        while (self._in_flight or self._queued_images) and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=True, cancel_futures=True)
