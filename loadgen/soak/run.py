"""`gorgo soak`: the local stack under a steady open loop near capacity, flow control and
classes on, two routers sharing the fleet over NATS, and every few minutes one fault from
the catalog below; then per fault the requests it failed (and whether only on the part it
hit), how long its part took to serve again, and the routers' memory and open files over
the run (loadgen.soak.judge). Everything on loopback; it stops by itself.

The load runs on its own thread (its own event loop); the faults, which start and stop the
stack's children, on the thread that owns the stack (a child gets its parent-death signal
when the thread that forked it ends)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from emulator.stack.settings import Region, StackPorts, StackSettings, regions_for_profile
from emulator.stack.stack import Stack
from ext_proc.common.files import write_atomic
from ext_proc.config.dump import config_as_dict
from ext_proc.config.flow import FlowControl
from ext_proc.config.load import config_from_dict
from loadgen.replay.loop import DEFAULT_MAX_CONCURRENCY, DEFAULT_TIMEOUT_S, Replay
from loadgen.sim.classes import Classes, load_classes
from loadgen.soak.judge import (
    FRONT_DOOR,
    FaultRecord,
    Outcome,
    Sample,
    flatness,
    judge,
    table,
)
from loadgen.traces.synthetic import paper_synthetic
from loadgen.traces.windows import scaled

CLASSES = Path(__file__).resolve().parents[1] / "data" / "classes" / "interactive-batch.yaml"
# The paper-shaped window's rate (573 users x 14.6 requests in 30 min: 4.65/s) at
# time_scale 1; 0.75 was the last load before saturation on this fleet (docs/results.md,
# live peers bench), so 1.0 is near capacity with room for the faults' lost capacity.
DEFAULT_TIME_SCALE = 1.0
WARMUP_S = 120.0
# The last fault is lifted this long before the end, so its recovery is inside the run.
TAIL_S = 150.0
# How long a faulted part may take to serve again before it counts as not recovered.
RECOVERY_LIMIT_S = 90.0
# A stall or a frozen link lasts this long.
HOLD_S = 20.0
SAMPLE_EVERY_S = 10.0
FLAT_WINDOW_S = 300.0
# The workload's tiles: as long as a memory window, so each window sees the same load.
TILE_S = FLAT_WINDOW_S
TILE_IDS = 1_000_000  # apart: a tile has some 1,400 requests and 100k blocks
# What a careless edit leaves: not even YAML.
BROKEN_CONFIG = "listen: {grpc: 127.0.0.1:1\nbackends: [\n"
EXTRA = Region("us-extra", 5.0)


@dataclass
class SoakOptions:
    minutes: float = 30.0
    time_scale: float = DEFAULT_TIME_SCALE
    seed: int = 0
    out: str | None = None


def _get(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.load(r)


def _admin(url: str, method: str, token_headers: dict[str, str], body: Any = None) -> int:
    data = json.dumps(body if body is not None else {}).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=token_headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


class Soak:
    """One run: the stack, the load's thread, the faults, the samples."""

    def __init__(self, opts: SoakOptions, progress: Any = sys.stderr) -> None:
        self.opts = opts
        self.out = progress
        self.classes: Classes = load_classes(CLASSES)
        self.stack = _stack(opts.seed, self.classes)
        self.replay: Replay | None = None
        self.records: list[FaultRecord] = []
        self.samples: list[Sample] = []
        self.load_done = threading.Event()
        self.load_error: BaseException | None = None

    # -- clocks and views ------------------------------------------------------------

    def now_s(self) -> float:
        """Seconds on the load's clock (the replay's loop time is time.monotonic)."""
        assert self.replay is not None
        return time.monotonic() - self.replay.t0

    def say(self, line: str) -> None:
        print(f"gorgo soak: [{self.now_s():7.1f} s] {line}", file=self.out, flush=True)

    def routers(self) -> list[tuple[str, str]]:
        """(process name, admin URL) of each router."""
        extra = [
            (f"{c.bus.router_id}-gorgo-serve", f"http://{c.listen.admin}")
            for c in self.stack.extra_routers
        ]
        return [("gorgo-serve", self.stack.admin_url), *extra]

    def served_since(self, since_s: float, backend: str | None = None) -> float | None:
        """When a request sent after since_s was first answered with success (by `backend`,
        when named)."""
        assert self.replay is not None
        ends = [
            s.sent_s + (s.result.e2e_ms or 0.0) / 1e3
            for s in list(self.replay.sent)
            if s.sent_s >= since_s
            and s.result.status == "ok"
            and backend in (None, s.result.backend)
        ]
        return min(ends) if ends else None

    def wait(
        self, done: Callable[[], float | None], limit_s: float = RECOVERY_LIMIT_S
    ) -> float | None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not self.load_done.is_set():
            try:
                at = done()
            except (OSError, urllib.error.URLError, ValueError, KeyError, TypeError):
                at = None
            if at is not None:
                return at
            time.sleep(0.2)
        return None

    def sample(self) -> None:
        rss = 0.0
        fds = 0
        for name, _ in self.routers():
            proc = self.stack.procs.get(name)
            if proc is None:
                continue
            try:
                p = psutil.Process(proc.pid)
                rss += p.memory_info().rss / 2**20
                fds += p.num_fds()
            except psutil.Error:
                continue
        self.samples.append(Sample(self.now_s(), rss, fds))

    # -- the faults ------------------------------------------------------------------

    def kill(self, name: str) -> None:
        os.kill(self.stack.procs[name].pid, signal.SIGKILL)

    def restarted(self, name: str, after_mono: float) -> bool:
        return any(r.name == name and r.at_s > after_mono for r in self.stack.restarts)

    def faults(self) -> list[tuple[str, Callable[[], FaultRecord]]]:
        regions = [r.id for r in self.stack.settings.regions]
        return [
            ("router kill -9", self.router_kill),
            ("engine kill -9", lambda: self.engine_kill(regions[1])),
            ("engine stall", lambda: self.engine_stall(2, regions[2])),
            ("WAN link frozen", lambda: self.link_frozen(regions[0])),
            ("Envoy kill -9", self.envoy_kill),
            ("NATS kill -9", self.nats_kill),
            ("config reload (good)", self.reload_good),
            ("config reload (bad)", self.reload_bad),
            ("backend added", self.backend_added),
            ("backend removed", self.backend_removed),
        ]

    def router_kill(self) -> FaultRecord:
        at, mono = self.now_s(), time.monotonic()
        self.kill("gorgo-serve")

        def deciding() -> float | None:
            if not self.restarted("gorgo-serve", mono):
                return None
            state = _get(f"{self.stack.admin_url}/state")
            return self.now_s() if int(state["decisions"]) > 0 else None

        return FaultRecord(
            "router kill -9",
            FRONT_DOOR,
            at,
            at,
            self.wait(deciding),
            "one of two routers; Envoy fails open meanwhile",
        )

    def engine_kill(self, region: str) -> FaultRecord:
        at = self.now_s()
        self.kill(f"engine-{region}")
        return FaultRecord(
            "engine kill -9", region, at, at, self.wait(lambda: self.served_since(at, region))
        )

    def engine_stall(self, i: int, region: str) -> FaultRecord:
        url = f"{self.stack.engine_url(i)}/faults"
        at = self.now_s()
        _admin(
            url, "POST", {"Content-Type": "application/json"}, {"stall_rate": 1.0, "stall_ms": 5000}
        )
        time.sleep(HOLD_S)
        _admin(url, "POST", {"Content-Type": "application/json"}, {"stall_rate": 0.0})
        healed = self.now_s()
        return FaultRecord(
            "engine stall",
            region,
            at,
            healed,
            self.wait(lambda: self.served_since(healed, region)),
            f"every request held 5 s, for {HOLD_S:.0f} s",
        )

    def link_frozen(self, region: str) -> FaultRecord:
        pid = self.stack.procs[f"wan-{region}"].pid
        at = self.now_s()
        os.kill(pid, signal.SIGSTOP)
        time.sleep(HOLD_S)
        os.kill(pid, signal.SIGCONT)
        healed = self.now_s()
        return FaultRecord(
            "WAN link frozen",
            region,
            at,
            healed,
            self.wait(lambda: self.served_since(healed, region)),
            f"SIGSTOP for {HOLD_S:.0f} s",
        )

    def envoy_kill(self) -> FaultRecord:
        at = self.now_s()
        self.kill("envoy")
        return FaultRecord(
            "Envoy kill -9",
            FRONT_DOOR,
            at,
            at,
            self.wait(lambda: self.served_since(at)),
            "the front door itself: its open streams are cut",
        )

    def nats_kill(self) -> FaultRecord:
        at, mono = self.now_s(), time.monotonic()
        self.kill("nats")

        def connected() -> float | None:
            if not self.restarted("nats", mono):
                return None
            states = [_get(f"{url}/state") for _, url in self.routers()]
            return self.now_s() if all(s["fleet"]["connected"] for s in states) else None

        return FaultRecord(
            "NATS kill -9", FRONT_DOOR, at, at, self.wait(connected), "both routers reconnected"
        )

    def _reload(self, text: str, counter: str) -> float | None:
        """Write the main router's config, SIGHUP it, and wait until its /state `reload`
        `counter` (reloads, failures) grew: when it did (None: not within the limit)."""

        def count() -> int:
            return int(_get(f"{self.stack.admin_url}/state")["reload"][counter])

        before = count()
        write_atomic(self.stack.workdir / "gorgo.yaml", text)
        os.kill(self.stack.procs["gorgo-serve"].pid, signal.SIGHUP)
        return self.wait(lambda: self.now_s() if count() > before else None)

    def reload_good(self) -> FaultRecord:
        raw = _yaml((self.stack.workdir / "gorgo.yaml").read_text())
        routing = raw.setdefault("routing", {})
        routing["eject_s"] = float(routing.get("eject_s", 5.0)) + 1.0
        at = self.now_s()
        applied = self._reload(_dump(raw), "reloads")
        return FaultRecord(
            "config reload (good)", FRONT_DOOR, at, at, applied, "routing.eject_s +1 s, SIGHUP"
        )

    def reload_bad(self) -> FaultRecord:
        good = (self.stack.workdir / "gorgo.yaml").read_text()
        at = self.now_s()
        refused_at = self._reload(BROKEN_CONFIG, "failures")
        healed = self.now_s()
        back = self._reload(good, "reloads")  # the operator fixes the file
        note = "not YAML, SIGHUP refused" if refused_at is not None else "refusal NOT seen"
        return FaultRecord(
            "config reload (bad)", FRONT_DOOR, at, healed, back, f"{note}; then the file fixed"
        )

    def backend_added(self) -> FaultRecord:
        item = self.stack.add_engine(EXTRA)
        at = self.now_s()
        for _, url in self.routers():
            _admin(f"{url}/backends", "POST", self.stack.admin_headers, item)
        return FaultRecord(
            "backend added",
            EXTRA.id,
            at,
            at,
            self.wait(lambda: self.served_since(at, EXTRA.id)),
            f"{EXTRA.id}, {EXTRA.rtt_ms:g} ms away, POST /backends to both routers",
        )

    def backend_removed(self) -> FaultRecord:
        open_then = sum(
            int(_get(f"{url}/state")["backends"][EXTRA.id]["in_flight"])
            for _, url in self.routers()
        )
        at = self.now_s()
        for _, url in self.routers():
            _admin(f"{url}/backends/{EXTRA.id}", "DELETE", self.stack.admin_headers)

        def gone() -> float | None:
            states = [_get(f"{url}/state") for _, url in self.routers()]
            return self.now_s() if all(EXTRA.id not in s["backends"] for s in states) else None

        return FaultRecord(
            "backend removed",
            EXTRA.id,
            at,
            at,
            self.wait(gone),
            f"DELETE /backends with {open_then} in flight on it: drained, then removed",
        )

    # -- the run ---------------------------------------------------------------------

    def _load(self, trace: Sequence[Any]) -> None:
        async def go() -> None:
            header = FlowControl().objective_header
            self.replay = Replay(
                trace,
                self.stack.front_door_url,
                api="chat",
                max_concurrency=DEFAULT_MAX_CONCURRENCY,
                timeout_s=DEFAULT_TIMEOUT_S,
                stop=None,
                progress=None,
                label="soak",
                headers_for=lambda r: {header: self.classes.objective_of(r.session)},
            )
            await self.replay.run()

        try:
            asyncio.run(go())
        except BaseException as e:  # reported by the caller
            self.load_error = e
        finally:
            self.load_done.set()

    def run(self) -> dict[str, Any]:
        total_s = self.opts.minutes * 60.0
        trace = _trace(self.opts, total_s)
        self.stack.start(timeout_s=60.0)
        self.stack.supervise()
        try:
            loader = threading.Thread(target=self._load, args=(trace,), name="gorgo-soak-load")
            loader.start()
            while self.replay is None or self.replay.t0 == 0.0:
                if self.load_done.is_set():
                    raise RuntimeError(f"the load did not start: {self.load_error!r}")
                time.sleep(0.05)
            faults = self.faults()
            gap_s = max(1.0, (total_s - WARMUP_S - TAIL_S) / len(faults))
            due = [WARMUP_S + k * gap_s for k in range(len(faults))]
            self.say(
                f"{len(trace)} requests over {total_s / 60:g} min; "
                f"{len(faults)} faults every {gap_s:.0f} s from {WARMUP_S:.0f} s"
            )
            next_sample = next_line = 0.0
            while not self.load_done.is_set():
                if self.now_s() >= next_sample:
                    self.sample()
                    next_sample += SAMPLE_EVERY_S
                if self.now_s() >= next_line:  # progress, one line a minute
                    st = self.replay.status
                    self.say(
                        f"{st.done} of {st.total} done, {st.errors} not ok, "
                        f"{st.in_flight} in flight"
                    )
                    next_line += 60.0
                if faults and self.now_s() >= due[len(self.records)]:
                    name, do = faults.pop(0)
                    self.say(f"fault: {name}")
                    rec = do()
                    self.records.append(rec)
                    rec_s = (
                        "not recovered"
                        if rec.recovered_s is None
                        else (f"serving again {rec.recovered_s - rec.healed_s:.1f} s after its end")
                    )
                    self.say(f"{name}: {rec_s}")
                time.sleep(0.2)
            loader.join()
        finally:
            self.stack.stop()
        if self.load_error is not None:
            raise RuntimeError(f"the load failed: {self.load_error!r}")
        return self.report()

    def report(self) -> dict[str, Any]:
        assert self.replay is not None
        outcomes = [
            Outcome(
                s.sent_s,
                s.sent_s + (s.result.e2e_ms or 0.0) / 1e3,
                s.result.backend,
                s.result.status == "ok",
                refused=s.result.error.startswith("HTTP 429"),
                error=s.result.error,
            )
            for s in self.replay.sent
        ]
        rows, unexplained = judge(self.records, outcomes)
        # The main router restarts at the first fault: its memory is judged from then on.
        warm_s = (
            (self.records[0].recovered_s or self.records[0].at_s) + WARMUP_S
            if self.records
            else WARMUP_S
        )
        flat = flatness(self.samples, warm_s, FLAT_WINDOW_S)
        print(table(rows), file=self.out)
        failed = sum(1 for o in outcomes if not (o.ok or o.refused))
        refused = sum(1 for o in outcomes if o.refused)
        print(
            f"requests: {len(outcomes)} sent, {failed} failed, {refused} refused (429, "
            f"sheddable), {len(unexplained)} failed outside every fault's window",
            file=self.out,
        )
        if flat is not None:
            print(
                f"routers' RSS {flat.first_rss_mb:.1f} -> {flat.last_rss_mb:.1f} MB "
                f"(x{flat.rss_ratio:.3f}), open fds {flat.first_fds:.1f} -> {flat.last_fds:.1f} "
                f"(x{flat.fds_ratio:.3f}): {'flat' if flat.flat else 'NOT flat'}",
                file=self.out,
            )
        else:  # said, not passed over: a short run cannot judge memory
            print(
                f"memory not judged: the run is too short for two {FLAT_WINDOW_S / 60:.0f}-minute "
                "windows after the warm-up (15 minutes or more judge it)",
                file=self.out,
            )
        result = {
            "minutes": self.opts.minutes,
            "time_scale": self.opts.time_scale,
            "requests": len(outcomes),
            "failed": failed,
            "refused": refused,
            "unexplained": [asdict(o) for o in unexplained],
            "failures": [asdict(o) for o in outcomes if not (o.ok or o.refused)],
            "faults": [
                {
                    **asdict(r.record),
                    "requests": r.requests,
                    "failed": r.failed,
                    "failed_elsewhere": r.failed_elsewhere,
                    "reasons": dict(r.reasons),
                    "recover_s": r.recover_s,
                }
                for r in rows
            ],
            "samples": [asdict(s) for s in self.samples],
            "flatness": None if flat is None else {**asdict(flat), "flat": flat.flat},
        }
        if self.opts.out:
            write_atomic(Path(self.opts.out), json.dumps(result, indent=1))
        return result


def _yaml(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _dump(raw: Any) -> str:
    import yaml

    return str(yaml.safe_dump(raw, sort_keys=False))


def _trace(opts: SoakOptions, total_s: float) -> list[Any]:
    """A steady load: the paper-shaped window at its rate in tiles of TILE_S, each its own
    users (a seed of its own; ids, blocks and sessions apart), stretched by time_scale (2:
    half the rate); cut at the run's end. One window over the whole run is not steady:
    its conversations grow, and its prompts with them (3.1k tokens on average in its first
    3 minutes, 11.5k in its last: 3.4x the load), so the fleet saturated in the last
    minutes."""
    tiles = []
    for k in range(math.ceil(total_s / TILE_S)):
        base = paper_synthetic(
            opts.seed * 1000 + k,
            duration_s=TILE_S / opts.time_scale,
            users=max(1, round(573 * TILE_S / opts.time_scale / 1800)),  # the window's rate
        )
        tiles += [
            replace(
                r,
                index=k * TILE_IDS + r.index,
                arrival_s=k * TILE_S + r.arrival_s,
                block_ids=tuple(k * TILE_IDS * 1000 + b for b in r.block_ids),
                session=f"{k}-{r.session}",
            )
            for r in scaled(base, opts.time_scale)
        ]
    return [r for r in tiles if r.arrival_s < total_s - 30.0]


def _stack(seed: int, classes: Classes) -> Stack:
    """The default fleet (network RTTs) behind one Envoy and two routers over NATS, the
    routers with flow control and the classes' objectives on."""
    stack = Stack(
        StackSettings(
            regions=regions_for_profile("network"),
            ports=StackPorts.ephemeral(3),
            rtt_profile="network",
            routers=2,
            seed=seed,
            keep_logs=False,
        )
    )
    raw = config_as_dict(stack.config)
    flow = dict(raw.get("flow_control") or {})
    flow.update(enabled=True, objectives=list(classes.objectives))
    raw["flow_control"] = flow
    stack.config = config_from_dict(raw)
    stack.extra_routers = [
        replace(c, flow_control=stack.config.flow_control) for c in stack.extra_routers
    ]
    return stack


def run_soak(opts: SoakOptions) -> int:
    result = Soak(opts).run()
    bad = [f for f in result["faults"] if f["failed_elsewhere"] or f["recover_s"] is None]
    flat = result["flatness"]
    ok = not bad and not result["unexplained"] and (flat is None or flat["flat"])
    return 0 if ok else 1
