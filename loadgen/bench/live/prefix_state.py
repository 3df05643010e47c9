"""`gorgo bench prefix-state`: how right the router's prefix state is live, precise against
approximate.

One slice of the conversation trace is replayed through Envoy, the router and the emulated
fleet on two isolated fleets at once: one whose engines publish their KV events, which the
router subscribes to (precise), and one without (approximate: the router's own index).
`--front-doors N` gives the precise fleet a front door (an Envoy and a router) in each of
the first N regions, each conversation entering one; `--engine vllm` runs real vLLM engines
(the tiny model) instead of the twins.
Per request, the router's predicted cached tokens on the backend it chose, taken from its
decision span (`gorgo.predicted_cached_tokens`, `gorgo.prefix_state`; received here over
OTLP, joined on the request id the client sends), against what that engine reported in the
response's usage (`prompt_tokens_details.cached_tokens`): the error as a share of the
prompt, as the simulator's `prediction_error` computes it. Also the engine-reported cache
hit rate and p95 TTFT and E2E, and the precise/approximate ratios.

The engines run the default profile with prefill x4 (as `gorgo bench live`), so a slice
at time_scale 1 loads the fleet without saturating it and wall time stays near the
slice's length.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from emulator.stack.ports import free_ports
from emulator.stack.settings import DEFAULT_REGIONS, StackPorts, StackSettings
from emulator.stack.stack import Stack
from ext_proc.common.names import HEADER_REQUEST_ID
from ext_proc.config.schema import Config
from ext_proc.service.telemetry.spans import (
    A_BACKEND,
    A_PREDICTED_CACHED,
    A_PREFIX_STATE,
    A_REQUEST_ID,
)
from loadgen.bench.live.parity import fast_profile_file
from loadgen.client.stream import percentile
from loadgen.replay.loop import Replay, ReplayRun
from loadgen.replay.requests import Encoded, build_request
from loadgen.results import RequestResult, summarize, write_result
from loadgen.traces.readers import read_trace
from loadgen.traces.request import TraceRequest
from loadgen.traces.windows import scaled, window

MODES = ("precise", "approximate")
# The served name of the real-vLLM tier's tiny model (emulator/vllm/serve.py).
VLLM_MODEL = "tiny"
# The router's batch exporter sends every 5 s: wait that long and more for the last spans.
SPAN_WAIT_S = 20.0
# The precise fleet starts measuring once every engine's event stream is up.
PRECISE_WAIT_S = 20.0


@dataclass(frozen=True)
class Prediction:
    backend: str
    prefix_state: str
    cached_tokens: int


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping, per request id, what its decision predicted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.predictions: dict[str, Prediction] = {}

    def Export(self, request: Any, context: Any) -> Any:
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self._keep(span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _keep(self, span: Any) -> None:
        attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}
        if A_REQUEST_ID not in attrs or A_PREDICTED_CACHED not in attrs:
            return
        with self.lock:
            self.predictions[str(attrs[A_REQUEST_ID])] = Prediction(
                str(attrs[A_BACKEND]), str(attrs[A_PREFIX_STATE]), int(attrs[A_PREDICTED_CACHED])
            )

    def has_all(self, request_ids: set[str]) -> bool:
        with self.lock:
            return request_ids <= self.predictions.keys()

    def snapshot(self) -> dict[str, Prediction]:
        with self.lock:
            return dict(self.predictions)


@contextmanager
def span_sink(port: int) -> Iterator[SpanSink]:
    """A receiver on a loopback port (a thread-pool server: the replay's event loop stays
    the client's). Start it after the stacks: a process that runs gRPC threads cannot
    safely fork their children."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    sink = SpanSink()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield sink
    finally:
        server.stop(None)


class TaggedReplay(Replay):
    """The live replay, each request sent with its trace id as `x-request-id` (the front
    door keeps a client's id), so its decision span can be found; `model` names the served
    model (None: the replay's own, which any twin serves)."""

    model: str | None = None

    def prepare(self, r: TraceRequest) -> Encoded:
        req = build_request(r, self.api, self.synth)
        body = req.body if self.model is None else {**req.body, "model": self.model}
        e = replace(req, body=body, headers={**req.headers, HEADER_REQUEST_ID: r.id})
        return e.encoded()


def with_predictions(
    results: Sequence[RequestResult], predictions: Mapping[str, Prediction]
) -> list[RequestResult]:
    """The result rows, each with the router's prediction when its span names the backend
    that answered."""
    out = []
    for r in results:
        p = predictions.get(r.id)
        known = p.cached_tokens if p is not None and p.backend == r.backend else None
        out.append(replace(r, predicted_cached_tokens=known))
    return out


@dataclass(frozen=True)
class PrefixReport:
    """One run's figures (None: nothing to take them over). Written into its result file's
    meta as a dict, in this order."""

    requests: int
    ok: int  # successful, with a prompt
    joined: int  # of which with the router's prediction on the backend that answered
    precise_share: float | None  # of the joined, decided on precise prefix state
    mispredicted: int  # joined, with a prediction error
    error_mean: float | None  # |predicted - cached| / prompt tokens, over the joined
    error_p95: float | None
    hit_rate: float | None  # engine-reported cached / prompt tokens, over the ok
    predicted_hit_rate: float | None  # predicted cached / prompt tokens, over the joined
    ttft_p95_ms: float | None
    e2e_p95_ms: float | None


# The figures set side by side as precise / approximate.
RATIO_FIELDS = (
    "error_mean",
    "error_p95",
    "hit_rate",
    "predicted_hit_rate",
    "ttft_p95_ms",
    "e2e_p95_ms",
)


def prefix_report(
    results: Sequence[RequestResult], predictions: Mapping[str, Prediction]
) -> PrefixReport:
    """Per run: the prediction error share (mean, p95) over the successful requests with a
    prediction and an engine report, which states those predictions came from, the engine's
    hit rate (cached / prompt tokens) and the router's predicted one, p95 TTFT and E2E."""
    ok = [r for r in results if r.status == "ok" and r.input_tokens > 0]
    joined = [r for r in with_predictions(ok, predictions) if r.predicted_cached_tokens is not None]
    errors = [
        abs((r.predicted_cached_tokens or 0) - r.cached_tokens) / r.input_tokens for r in joined
    ]
    states = [predictions[r.id].prefix_state for r in joined]
    prompt = sum(r.input_tokens for r in ok)
    s = summarize(results)
    return PrefixReport(
        requests=len(results),
        ok=len(ok),
        joined=len(joined),
        precise_share=states.count("precise") / len(states) if states else None,
        mispredicted=sum(e > 0 for e in errors),
        error_mean=sum(errors) / len(errors) if errors else None,
        error_p95=percentile(errors, 95) if errors else None,
        hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        predicted_hit_rate=sum(r.predicted_cached_tokens or 0 for r in joined)
        / sum(r.input_tokens for r in joined)
        if joined
        else None,
        ttft_p95_ms=s["ttft_ms"]["p95"],
        e2e_p95_ms=s["e2e_ms"]["p95"],
    )


def ratios(precise: PrefixReport, approximate: PrefixReport) -> dict[str, float | None]:
    """RATIO_FIELDS' precise / approximate (None when either is unknown or the
    approximate one is 0)."""
    a, b = asdict(precise), asdict(approximate)
    return {k: None if a[k] is None or not b[k] else a[k] / b[k] for k in RATIO_FIELDS}


# -- the table ------------------------------------------------------------------------------


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.3%}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"x{v:.2f}"


def report_table(reports: Mapping[str, PrefixReport]) -> str:
    """A row per run, and the precise / approximate ratios when both ran."""
    lines = [
        "| prefix state | ok / joined | precise decisions | mispredicted | error mean | "
        "error p95 | hit rate (engine) | hit rate (predicted) | TTFT p95 ms | E2E p95 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in reports.items():
        lines.append(
            f"| {mode} | {r.ok} / {r.joined} | {_share(r.precise_share)} | "
            f"{r.mispredicted} | {_pct(r.error_mean)} | {_pct(r.error_p95)} | "
            f"{_pct(r.hit_rate)} | {_pct(r.predicted_hit_rate)} | "
            f"{_ms(r.ttft_p95_ms)} | {_ms(r.e2e_p95_ms)} |"
        )
    if set(MODES) <= set(reports):
        x = ratios(reports["precise"], reports["approximate"])
        lines.append(
            "| precise / approximate | | | | "
            + " | ".join(_ratio(x[k]) for k in RATIO_FIELDS)
            + " |"
        )
    return "\n".join(lines)


def _state(stack: Stack) -> dict[str, Any]:
    with urllib.request.urlopen(f"{stack.admin_url}/state", timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


def _wait(ok: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@dataclass(frozen=True)
class Fleet:
    """What the two fleets run: front doors (an Envoy and a router in each of the first N
    regions, all subscribed to the engines' events), and real vLLM engines or the twins."""

    front_doors: int = 1
    real_engine: bool = False
    # Real engines serve 4,096-token contexts: longer trace requests are left out.
    max_input_tokens: int | None = None
    # Which fleets run (both by default: their ratios are the point; one to spare cores).
    modes: tuple[str, ...] = MODES


def _stack(profile: str, kv_events: bool, otlp_port: int, fleet: Fleet) -> Stack:
    regions = DEFAULT_REGIONS
    stack = Stack(
        StackSettings(
            policy="gorgo",
            regions=regions,
            ports=StackPorts.ephemeral(len(regions)),
            rtt_profile="network",
            engine_profile=None if fleet.real_engine else profile,
            tuner_mode="off",  # static weights: the two fleets differ only in prefix state
            kv_events=kv_events,
            real_engine=fleet.real_engine,
            vllm_small_pool=(),
            front_door_regions=tuple(r.id for r in regions[1 : fleet.front_doors])
            if kv_events
            else (),
        )
    )

    # Every router sends its decision spans to this run's receiver.
    def traced(cfg: Config) -> Config:
        return replace(
            cfg, telemetry=replace(cfg.telemetry, otlp_endpoint=f"127.0.0.1:{otlp_port}")
        )

    stack.config = traced(stack.config)
    for door in stack.doors:
        door.config = traced(door.config)
    return stack


def _door_urls(stack: Stack) -> list[str]:
    return [stack.front_door_url, *(d.url for d in stack.doors)]


def _all_precise(stack: Stack) -> bool:
    states = [_state(stack), *(_get_state(d.admin_url) for d in stack.doors)]
    return all(b["prefix_state"] == "precise" for st in states for b in st["backends"].values())


def _get_state(admin_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{admin_url}/state", timeout=5) as r:
        doc: dict[str, Any] = json.loads(r.read())
    return doc


async def _replay_all(
    stacks: Mapping[str, Stack], trace: Sequence[TraceRequest], real_engine: bool = False
) -> dict[str, ReplayRun]:
    """Each fleet replays the whole slice; with several front doors each conversation
    enters one door (by its session), as clients in several regions would."""

    model = VLLM_MODEL if real_engine else None

    async def one(url: str, requests: Sequence[TraceRequest], label: str) -> ReplayRun:
        replay = TaggedReplay(
            requests,
            url,
            api="completions",
            max_concurrency=512,
            timeout_s=600.0,
            progress=sys.stderr,
            stop=None,
            label=label,
        )
        replay.model = model
        return await replay.run()

    async def fleet(name: str, stack: Stack) -> ReplayRun:
        urls = _door_urls(stack)
        shares = [
            [r for r in trace if _door_of(r.session, len(urls)) == i] for i in range(len(urls))
        ]
        runs = await asyncio.gather(
            *(
                one(u, part, name if len(urls) == 1 else f"{name} door {i}")
                for i, (u, part) in enumerate(zip(urls, shares, strict=True))
                if part
            )
        )
        return replace(
            runs[0],
            sent=[x for run in runs for x in run.sent],
            planned=sum(run.planned for run in runs),
            wall_s=max(run.wall_s for run in runs),
        )

    runs = await asyncio.gather(*(fleet(name, s) for name, s in stacks.items()))
    return dict(zip(stacks, runs, strict=True))


def _door_of(session: str, doors: int) -> int:
    return int.from_bytes(session.encode()[-4:].rjust(4, b"\0"), "big") % doors


def run_prefix_bench(
    trace_path: str,
    start_s: float,
    duration_s: float,
    limit: int | None,
    time_scale: float,
    out_dir: Path,
    fleet: Fleet = Fleet(),
) -> int:
    requests = read_trace(trace_path)
    if fleet.max_input_tokens is not None:
        requests = [r for r in requests if r.input_tokens <= fleet.max_input_tokens]
    chosen = window(requests, start_s, duration_s, limit)
    if not chosen:
        print("gorgo bench prefix-state: no requests in the slice", file=sys.stderr)
        return 2
    trace = scaled(chosen, time_scale)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gorgo-prefix-") as tmp, ExitStack() as sinks:
        profile = fast_profile_file(Path(tmp))
        otlp_ports = dict(zip(fleet.modes, free_ports(len(fleet.modes)), strict=True))
        stacks = {
            mode: _stack(profile, mode == "precise", otlp_ports[mode], fleet)
            for mode in fleet.modes
        }
        print(
            f"bench prefix-state: {len(trace)} requests ({start_s:g} s + {duration_s:g} s of "
            f"{Path(trace_path).name}, time_scale {time_scale:g}) on isolated fleets: "
            f"{', '.join(fleet.modes)} (precise: KV events, {fleet.front_doors} front "
            f"door(s)), on {'real vLLM engines' if fleet.real_engine else 'the twins'}...",
            file=sys.stderr,
        )
        try:
            for s in stacks.values():
                s.start()
            receivers = {m: sinks.enter_context(span_sink(p)) for m, p in otlp_ports.items()}
            if "precise" in stacks and not _wait(
                partial(_all_precise, stacks["precise"]), PRECISE_WAIT_S
            ):
                raise RuntimeError("the precise fleet's KV event streams did not come up")
            runs = asyncio.run(_replay_all(stacks, trace, fleet.real_engine))
            for mode, run in runs.items():  # the last spans come with the next batch export
                sink = receivers[mode]
                wanted = {r.id for r in run.results if r.status == "ok"}
                if not _wait(partial(sink.has_all, wanted), SPAN_WAIT_S):
                    missing = len(wanted - sink.snapshot().keys())
                    print(f"{mode}: {missing} decision spans never arrived", file=sys.stderr)
            states = {mode: _state(s) for mode, s in stacks.items()}
        finally:
            for s in stacks.values():
                s.stop()
    reports: dict[str, PrefixReport] = {}
    for mode, run in runs.items():
        predictions = receivers[mode].snapshot()
        rows = with_predictions(run.results, predictions)
        reports[mode] = prefix_report(run.results, predictions)
        kv = {
            b: {k: v["kv_events"][k] for k in ("gaps", "resets")}
            for b, v in states[mode]["backends"].items()
            if "kv_events" in v
        }
        meta = {
            "tool": "gorgo bench prefix-state",
            "prefix_state": mode,
            "trace": trace_path,
            "window": {"start_s": start_s, "duration_s": duration_s, "limit": limit},
            "time_scale": time_scale,
            "front_doors": fleet.front_doors if mode == "precise" else 1,
            "engines": "vllm" if fleet.real_engine else "twin",
            "wall_s": round(run.wall_s, 1),
            "report": asdict(reports[mode]),
            "kv_events": kv,
        }
        write_result(out_dir / f"prefix-state-{mode}.json", rows, meta)
    print(report_table(reports))
    print(
        f"{len(trace)} requests per fleet; wall {time.perf_counter() - t0:.0f} s; "
        f"result files in {out_dir}",
        file=sys.stderr,
    )
    return 0
