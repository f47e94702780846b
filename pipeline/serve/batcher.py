"""Dynamic batching: concurrent requests coalesce into one inference call.

Requests put their images on a queue and await a future. One worker task takes the first waiting
request, gathers more until `max_batch_size` images or `max_delay` has passed, runs the model on the
whole batch in a worker thread (the event loop keeps accepting requests meanwhile, so the next batch
fills while this one computes), then hands each request its rows. A bounded queue refuses work it could
not finish in time instead of letting latency grow without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
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
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._queued_images = 0
        self._in_flight = 0
        self._draining = False
        self._worker: asyncio.Task[None] | None = None
        # One inference thread: the runtime parallelises inside a batch; two batches at once would only
        # fight over the same cores.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")

    @property
    def queued_images(self) -> int:
        return self._queued_images

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="batcher")

    async def infer(self, images: np.ndarray) -> np.ndarray:
        """Model outputs for `images` [N, ...]; large requests are split into several batches."""
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
            self._queue.put_nowait(job)
        self._stats.on_queue(self._queued_images)
        self._in_flight += 1
        try:
            results = await asyncio.gather(*(job.future for job in jobs))
        finally:
            self._in_flight -= 1
        return results[0] if len(results) == 1 else np.concatenate(results)

    async def _collect(self) -> list[_Job]:
        """The next batch: the first job, then whatever arrives within max_delay, up to max_batch_size."""
        jobs = [await self._queue.get()]
        size = len(jobs[0].images)
        deadline = jobs[0].enqueued + self.max_delay_s
        while size < self.max_batch_size:
            if self._queue.empty():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                job = self._queue.get_nowait()
            if size + len(job.images) > self.max_batch_size:
                self._queue_front(job)
                break
            jobs.append(job)
            size += len(job.images)
        return jobs

    def _queue_front(self, job: _Job) -> None:
        # asyncio.Queue has no push-front; its deque is the documented-in-source storage.
        self._queue._queue.appendleft(job)  # type: ignore[attr-defined]
        self._queue._unfinished_tasks += 1  # type: ignore[attr-defined]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            live = [job for job in jobs if not job.future.done()]  # skip requests that timed out
            size = sum(len(job.images) for job in jobs)
            self._queued_images -= size
            self._stats.on_queue(self._queued_images)
            if not live:
                continue
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
