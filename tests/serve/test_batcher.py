import asyncio
import threading
import time

import numpy as np
import pytest

from pipeline.serve.batcher import BatchStats, Draining, DynamicBatcher, QueueFull


class Recorder:
    """A real model function (a fixed linear map) that records the batch sizes it was called with."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.sizes: list[int] = []
        self.delay_s = delay_s
        self.threads: set[str] = set()
        self.weights = np.arange(12, dtype=np.float32).reshape(4, 3)

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.sizes.append(len(batch))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        return batch @ self.weights


def _batches(n: int, width: int = 4) -> list[np.ndarray]:
    return [np.full((1, width), i, dtype=np.float32) for i in range(n)]


async def _with_batcher(model: Recorder, **kwargs: float) -> DynamicBatcher:
    options = {"max_batch_size": 8, "max_delay_s": 0.02, "max_queue_images": 1000} | kwargs
    batcher = DynamicBatcher(
        model, int(options["max_batch_size"]), options["max_delay_s"], int(options["max_queue_images"])
    )
    batcher.start()
    return batcher


def test_concurrent_requests_form_batches_and_get_their_own_rows() -> None:
    async def main() -> None:
        model = Recorder()
        batcher = await _with_batcher(model)
        inputs = _batches(20)
        outputs = await asyncio.gather(*(batcher.infer(x) for x in inputs))
        for x, y in zip(inputs, outputs, strict=True):
            np.testing.assert_array_equal(y, x @ model.weights)
        assert sum(model.sizes) == 20 and max(model.sizes) == 8  # coalesced, never above the limit
        assert len(model.sizes) <= 4
        assert model.threads and "MainThread" not in model.threads  # off the event loop
        await batcher.drain(1.0)

    asyncio.run(main())


def test_batch_size_one_turns_batching_off() -> None:
    async def main() -> None:
        model = Recorder()
        batcher = await _with_batcher(model, max_batch_size=1)
        await asyncio.gather(*(batcher.infer(x) for x in _batches(5)))
        assert model.sizes == [1] * 5
        await batcher.drain(1.0)

    asyncio.run(main())


def test_large_request_is_split_and_reassembled_in_order() -> None:
    async def main() -> None:
        model = Recorder()
        batcher = await _with_batcher(model, max_batch_size=4)
        x = np.arange(40, dtype=np.float32).reshape(10, 4)
        y = await batcher.infer(x)
        np.testing.assert_array_equal(y, x @ model.weights)
        assert sorted(model.sizes) == [2, 4, 4]
        await batcher.drain(1.0)

    asyncio.run(main())


def test_lone_request_waits_at_most_the_delay() -> None:
    async def main() -> None:
        batcher = await _with_batcher(Recorder(), max_delay_s=0.05)
        started = time.perf_counter()
        await batcher.infer(_batches(1)[0])
        assert time.perf_counter() - started < 2.0  # bounded by the delay, not by a full batch
        await batcher.drain(1.0)

    asyncio.run(main())


def test_full_queue_refuses_new_work() -> None:
    async def main() -> None:
        model = Recorder(delay_s=0.2)
        batcher = await _with_batcher(model, max_batch_size=2, max_queue_images=4)
        first = [asyncio.ensure_future(batcher.infer(x)) for x in _batches(4)]
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await batcher.infer(_batches(1)[0])
        await asyncio.gather(*first)
        await batcher.drain(1.0)

    asyncio.run(main())


def test_a_request_past_its_timeout_fails_alone_and_is_not_computed() -> None:
    """The server's 504: the slow batch holds the worker; a request queued behind it times out with TimeoutError,
    is skipped when its turn comes, and the batcher serves the next request normally."""

    async def main() -> None:
        model = Recorder(delay_s=0.3)
        batcher = await _with_batcher(model, max_batch_size=1, max_delay_s=0.0)
        slow = asyncio.ensure_future(batcher.infer(_batches(1)[0]))
        await asyncio.sleep(0.05)  # the worker is computing it
        with pytest.raises(TimeoutError):
            await batcher.infer(np.full((1, 4), 7, dtype=np.float32), timeout_s=0.05)
        assert not slow.done()  # it timed out on its own clock, not when the slow batch let go
        assert (await slow).shape == (1, 3)
        answer = await batcher.infer(np.full((1, 4), 2, dtype=np.float32), timeout_s=5.0)
        assert answer.tolist() == (np.full((1, 4), 2, dtype=np.float32) @ model.weights).tolist()
        assert model.sizes == [1, 1]  # the timed-out request never reached the model
        assert batcher.queued_images == 0
        await batcher.drain(1.0)

    asyncio.run(main())


def test_drain_finishes_queued_work_then_refuses() -> None:
    async def main() -> None:
        model = Recorder(delay_s=0.05)
        batcher = await _with_batcher(model, max_batch_size=2)
        pending = [asyncio.ensure_future(batcher.infer(x)) for x in _batches(6)]
        await asyncio.sleep(0)
        await batcher.drain(5.0)
        assert all(p.done() and p.exception() is None for p in pending)
        with pytest.raises(Draining):
            await batcher.infer(_batches(1)[0])

    asyncio.run(main())


def test_model_error_reaches_every_request_in_the_batch_and_batcher_survives() -> None:
    calls = {"n": 0}

    def flaky(batch: np.ndarray) -> np.ndarray:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("model exploded")
        return batch

    async def main() -> None:
        batcher = DynamicBatcher(flaky, 8, 0.02, 100)
        batcher.start()
        results = await asyncio.gather(*(batcher.infer(x) for x in _batches(3)), return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)
        ok = await batcher.infer(_batches(1)[0])
        assert ok.shape == (1, 4)
        await batcher.drain(1.0)

    asyncio.run(main())


def test_stats_hooks_see_batches_and_queue() -> None:
    seen: list[int] = []
    depths: list[int] = []

    async def main() -> None:
        batcher = DynamicBatcher(Recorder(), 8, 0.02, 100, BatchStats(lambda n, s: seen.append(n), depths.append))
        batcher.start()
        await asyncio.gather(*(batcher.infer(x) for x in _batches(8)))
        await batcher.drain(1.0)

    asyncio.run(main())
    assert sum(seen) == 8 and max(depths) >= 1 and depths[-1] == 0


def test_a_dead_worker_fails_liveness_and_waiting_requests() -> None:
    """If the worker loop itself dies (here: a stats hook raises), `alive` turns false, so /v2/health/live fails
    and the orchestrator restarts the server, and queued requests get an error instead of hanging."""

    def broken_hook(n: int, s: float) -> None:
        raise RuntimeError("hook bug")

    async def main() -> tuple[bool, bool, list[object]]:
        batcher = DynamicBatcher(Recorder(delay_s=0.05), 1, 0.0, 100, BatchStats(broken_hook, lambda depth: None))
        batcher.start()
        before = batcher.alive
        results = await asyncio.gather(*(batcher.infer(x) for x in _batches(3)), return_exceptions=True)
        await asyncio.sleep(0.05)
        return before, batcher.alive, results

    before, after, results = asyncio.run(asyncio.wait_for(main(), 10))
    assert before and not after
    assert all(isinstance(r, Exception) for r in results[1:])
