"""The live replay's asyncio shell: `replay` runs a `Replay`, which sends a trace open loop
on the event loop's clock. Request i is due at its arrival (already windowed and scaled);
while `max_concurrency` requests are in flight the next waits for a free slot, in arrival
order (`loadgen.client.concurrency.ConcurrencyCap`, the simulator's too), and how late it went out
(its *slip*) is recorded; TTFT and E2E start when it is sent. Bodies are built ahead
(`loadgen.replay.requests`) on a worker thread; `Progress` keeps the run's status, shown by
a tqdm bar on a terminal and as one line at the end otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Never, TextIO

import aiohttp
from tqdm import tqdm

from loadgen.client.concurrency import Admitted, ConcurrencyCap
from loadgen.client.stream import Result, percentile, send_stream
from loadgen.progress import bar
from loadgen.replay.requests import Encoded, build_request, to_result
from loadgen.results import RequestResult
from loadgen.traces.prompts import PromptSynth
from loadgen.traces.request import TraceRequest

# Headers a caller adds to a row's request (e.g. a front door's session or class header).
HeadersFor = Callable[[TraceRequest], Mapping[str, str]]

# The paper's client capped in-flight requests (at 64: `--protocol paper`). Without a cap
# (the `open` protocol) the replay still holds at most 256 (its connection pool): one
# engine's max_running_requests, far above what a 3-region fleet serves at time_scale 1.
DEFAULT_MAX_CONCURRENCY = 256
# A user-visible refresh rate that costs nothing next to the streams.
PROGRESS_INTERVAL_S = 0.25
# Bodies are synthesized and JSON-encoded ahead of their send time on a worker thread:
# in a burst (Mooncake has 10-16 rows on one timestamp) each request's own CPU work would
# delay every later one (measured at 17 req/s: slip p95 25 ms without, 9 ms with). Bodies
# for the next 2 s of the schedule, at most 256 of them (256 x a 126k-token prompt is
# the worst case: ~130 MB; Mooncake's mean prompt makes it ~12 MB).
PREPARE_AHEAD_S = 2.0
PREPARE_AHEAD_MAX = 256
DEFAULT_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------------------
# Progress line.


@dataclass
class Progress:
    total: int
    duration_s: float  # the schedule's last due time
    label: str = "replay"  # which run: several may run at once
    done: int = 0
    errors: int = 0
    in_flight: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    slip_ms: list[float] = field(default_factory=list)

    def sent(self, slip_s: float) -> None:
        self.in_flight += 1
        self.slip_ms.append(slip_s * 1e3)

    def finished(self, ok: bool, ttft_ms: float | None) -> None:
        self.in_flight -= 1
        self.done += 1
        if not ok:
            self.errors += 1
        elif ttft_ms is not None:
            self.ttft_ms.append(ttft_ms)

    def figures(self, elapsed_s: float) -> str:
        """Everything but the count done: the bar's postfix."""

        def ms(values: list[float], q: float) -> str:
            return "-" if not values else f"{percentile(values, q):.0f}"

        slip_max = f"{max(self.slip_ms):.0f}" if self.slip_ms else "-"
        return (
            f"{self.in_flight} in flight | {self.errors} errors | TTFT p50 "
            f"{ms(self.ttft_ms, 50)} p95 {ms(self.ttft_ms, 95)} ms | slip p95 "
            f"{ms(self.slip_ms, 95)} max {slip_max} ms | {elapsed_s:.0f}/{self.duration_s:.0f} s"
        )

    def line(self, elapsed_s: float) -> str:
        return f"{self.label} {self.done}/{self.total} done | {self.figures(elapsed_s)}"


# ---------------------------------------------------------------------------------------
# The asyncio shell.


@dataclass
class Sent:
    request: TraceRequest
    # Its slot: the item is the request's position in the schedule.
    dispatch: Admitted[int]
    # When the POST started (after the body was ready), seconds since the start; slip is
    # measured to here.
    sent_s: float
    result: RequestResult

    @property
    def index(self) -> int:
        return self.dispatch.item

    @property
    def slip_s(self) -> float:
        return self.sent_s - self.dispatch.due_s


@dataclass
class ReplayRun:
    sent: list[Sent]
    planned: int
    started_at: str
    wall_s: float
    interrupted: bool

    @property
    def results(self) -> list[RequestResult]:
        return [s.result for s in self.sent]


class _Shown:
    """The run's progress on `out`: a bar (requests done, the status as its postfix) when
    `out` is a terminal, else the status line once at the end; None: nothing."""

    def __init__(self, out: TextIO | None, status: Progress) -> None:
        self.out = out
        self.status = status
        self.bar: tqdm[Never] | None = None
        if out is not None:
            self.bar = bar(status.total, status.label, unit="req", file=out)

    def show(self, elapsed_s: float) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.update(self.status.done - self.bar.n)
            self.bar.set_postfix_str(self.status.figures(elapsed_s), refresh=False)

    def end(self, elapsed_s: float) -> None:
        if self.bar is None or self.out is None:
            return
        if self.bar.disable:  # not a terminal: the outcome in one plain line
            self.out.write(self.status.line(elapsed_s) + "\n")
            self.out.flush()
        else:
            self.show(elapsed_s)
        self.bar.close()


async def _pause(event: asyncio.Event, timeout: float | None) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


class Replay:
    """One live run of `replay()`: its options, the schedule, the results so far and the
    progress state. `run` schedules and dispatches, `one` sends one request, `ticker`
    refreshes the progress shown, `finish` collects the results."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        url: str,
        *,
        api: str,
        max_concurrency: int,
        timeout_s: float,
        progress: TextIO | None,
        stop: asyncio.Event | None,
        label: str = "replay",
        headers_for: HeadersFor | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.trace = trace
        self.url = url
        self.api = api
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.stop = stop or asyncio.Event()
        self.due = [r.arrival_s for r in trace]
        self.cap: ConcurrencyCap[int] = ConcurrencyCap(max_concurrency, self.now_s)
        self.arrived = 0  # requests whose due time came (sent, or waiting for a slot)
        self.status = Progress(len(trace), self.due[-1] if self.due else 0.0, label)
        self.shown = _Shown(progress, self.status)
        self.synth = PromptSynth()
        self.sent: list[Sent] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.prepared: dict[int, asyncio.Future[Encoded]] = {}
        self.started_at = datetime.now(UTC).isoformat(timespec="seconds")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="gorgo-replay-prompts")
        self.next_prepare = 0
        self.t0 = 0.0  # the loop's clock when the schedule started
        self.headers_for = headers_for

    def now_s(self) -> float:
        return self.loop.time() - self.t0

    # Bodies, prepared ahead on the worker thread (see PREPARE_AHEAD_S).

    def prepare_ahead(self, horizon_s: float) -> None:
        while (
            self.next_prepare < len(self.trace)
            and self.next_prepare - (self.arrived - self.cap.waiting) < PREPARE_AHEAD_MAX
            and self.due[self.next_prepare] <= horizon_s
        ):
            r = self.trace[self.next_prepare]
            self.prepared[self.next_prepare] = self.loop.run_in_executor(self.pool, self.prepare, r)
            self.next_prepare += 1

    def prepare(self, r: TraceRequest) -> Encoded:
        req = build_request(r, self.api, self.synth)
        if self.headers_for is not None:
            req = replace(req, headers={**req.headers, **self.headers_for(r)})
        return req.encoded()

    async def body_for(self, i: int) -> Encoded:
        fut = self.prepared.pop(i, None)
        return await fut if fut is not None else self.prepare(self.trace[i])

    # The steps.

    async def run(self) -> ReplayRun:
        stopper = asyncio.ensure_future(self.stop.wait())
        wall0 = time.perf_counter()
        connector = aiohttp.TCPConnector(limit=self.max_concurrency)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                # The first bodies are ready before the clock starts.
                self.prepare_ahead(PREPARE_AHEAD_S)
                if self.prepared:
                    await asyncio.wait(list(self.prepared.values()))
                self.t0 = self.loop.time()
                tick = asyncio.ensure_future(self.ticker())
                try:
                    await self.dispatch(session)
                    while self.tasks and not self.stop.is_set():
                        await asyncio.wait(
                            {*self.tasks, stopper}, return_when=asyncio.FIRST_COMPLETED
                        )
                    for task in self.tasks:
                        task.cancel()
                    await asyncio.gather(*self.tasks, return_exceptions=True)
                finally:
                    tick.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await tick
                    self.shown.end(max(0.0, self.now_s()))
        finally:
            stopper.cancel()
            for fut in self.prepared.values():
                fut.cancel()
            self.pool.shutdown(wait=False, cancel_futures=True)
        return self.finish(wall0)

    async def dispatch(self, session: aiohttp.ClientSession) -> None:
        """Each request arrives at its due time: sent then if a slot is free, else when
        one frees (`one` sends it), until everything arrived or stop was asked."""
        while self.arrived < len(self.trace) and not self.stop.is_set():
            self.prepare_ahead(self.now_s() + PREPARE_AHEAD_S)
            i = self.arrived
            wait = self.due[i] - self.now_s()
            if wait <= 0:
                self.arrived += 1
                self.launch(session, self.cap.arrive(i, self.due[i]))
            else:
                # Wake at the due time, or earlier to keep bodies prepared ahead.
                await _pause(self.stop, min(wait, PREPARE_AHEAD_S / 2))

    def launch(self, session: aiohttp.ClientSession, d: Admitted[int] | None) -> None:
        """Send a request given a slot (None: it waits for one)."""
        if d is None:
            return
        task = asyncio.ensure_future(self.one(session, d))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.prepare_ahead(self.now_s() + PREPARE_AHEAD_S)

    async def one(self, session: aiohttp.ClientSession, d: Admitted[int]) -> None:
        r = self.trace[d.item]
        item: Sent | None = None
        try:
            req = await self.body_for(d.item)
            item = Sent(r, d, self.now_s(), RequestResult(r.id))
            self.status.sent(item.slip_s)
            res = await send_stream(
                session, self.url, req.path, req.data, r.id, req.headers, self.timeout_s
            )
        except asyncio.CancelledError:
            res = Result(r.id, error="cancelled: the replay was interrupted")
        except Exception as e:  # building the body failed; keep the run going
            res = Result(r.id, error=f"cannot build the request: {e}")
        finally:
            # Its slot goes to the longest waiting (none once stop was asked).
            waited = self.cap.release()
            if not self.stop.is_set():
                self.launch(session, waited)
        if item is None:  # never got as far as the POST
            item = Sent(r, d, self.now_s(), RequestResult(r.id))
            self.status.sent(item.slip_s)
        item.result = to_result(r, res)
        item.result.slip_ms = item.slip_s * 1e3
        self.sent.append(item)
        self.status.finished(item.result.status == "ok", item.result.ttft_ms)

    async def ticker(self) -> None:
        while True:
            self.shown.show(max(0.0, self.now_s()))
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    def finish(self, wall0: float) -> ReplayRun:
        """The run's results, in schedule order; `wall0` is its perf_counter start."""
        self.sent.sort(key=lambda s: s.index)
        return ReplayRun(
            sent=self.sent,
            planned=len(self.trace),
            started_at=self.started_at,
            wall_s=time.perf_counter() - wall0,
            interrupted=self.stop.is_set(),
        )


async def replay(
    trace: Sequence[TraceRequest],
    url: str,
    *,
    api: str = "completions",
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    progress: TextIO | None = None,
    stop: asyncio.Event | None = None,
    label: str = "replay",
    headers_for: HeadersFor | None = None,
) -> ReplayRun:
    """Send `trace` (arrivals already windowed and scaled) to `url`, open loop. Setting
    `stop` ends the run early: nothing more is sent, requests in flight are cancelled and
    recorded as errors. `headers_for`: more headers for each row's request."""
    return await Replay(
        trace,
        url,
        api=api,
        max_concurrency=max_concurrency,
        timeout_s=timeout_s,
        progress=progress,
        stop=stop,
        label=label,
        headers_for=headers_for,
    ).run()
