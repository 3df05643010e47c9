"""`gorgo bench overhead`: what the router adds to a request, Envoy alone as the baseline.

Both proxies run side by side in the same run, in front of the same zero-delay engines,
and requests alternate between them, so machine noise hits both alike:
- "envoy": Envoy alone (same config, no ext_proc filter: the fallback route).
- "gorgo": the front door, ext_proc routing every request.
Reported: added latency to the first token (p50/p99) at concurrency 1 for 1k- and
32k-token prompts, the throughput ratio at concurrency 16, and the added time per
streamed token after the first.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from dataclasses import dataclass, replace

import aiohttp

from emulator.stack.ports import free_ports
from emulator.stack.settings import Region, StackPorts, StackSettings
from emulator.stack.stack import Stack
from ext_proc.envoy_config.bootstrap import render_envoy_config
from loadgen.bench.live.load import proc_cpu_s
from loadgen.bench.live.otlp_sink import OtlpSink
from loadgen.client.stream import Result, chat_body, percentile, send_chat
from loadgen.progress import bar
from loadgen.traces.prompts import block_text

REGIONS = (Region("us-ashburn", 0.0), Region("eu-frankfurt", 0.0), Region("ap-seoul", 0.0))
# Targets: added TTFT p50 <= 2 ms and p99 <= 5 ms at 1k and 32k tokens; <= 0.1 ms/token;
# throughput at concurrency 16 at least half Envoy alone's.
TARGET_P50_MS = 2.0
TARGET_P99_MS = 5.0
TARGET_PER_TOKEN_MS = 0.1
# The router's CPU per request at 1k tokens (the target with an OTLP endpoint set).
TARGET_CPU_MS = 2.0
HEADER = f"{'measurement':<34} {'envoy alone':>12} {'envoy+gorgo':>12} {'added':>9} {'target':>8}"
TARGET_THROUGHPUT_RATIO = 0.5
# Long prompts: 128k-token prompts from 32 clients, added TTFT p99.
TARGET_LONG_P99_MS = 100.0


def _prompt(tokens: int) -> str:
    # exactly `tokens` tokens under the approximation and the engines' tiny BPE alike
    return block_text(0, tokens)


@dataclass
class Pair:
    envoy: list[Result]
    gorgo: list[Result]


async def _alternate(urls: tuple[str, str], body: dict[str, object], n: int) -> Pair:
    """n requests to each proxy, one at a time, alternating which goes first."""
    envoy, gorgo = await _rotate(urls, body, n)
    return Pair(envoy, gorgo)


async def _rotate(urls: tuple[str, ...], body: dict[str, object], n: int) -> list[list[Result]]:
    """n requests to each proxy, one at a time, the order rotated each round."""
    out: list[list[Result]] = [[] for _ in urls]
    with bar(n, "rounds", unit="round", leave=False) as rounds:
        async with aiohttp.ClientSession() as s:
            for i in range(n):
                for k in range(len(urls)):
                    which = (i + k) % len(urls)
                    out[which].append(await send_chat(s, urls[which], body, f"b{i}"))
                rounds.update()
    return out


async def _concurrent(
    url: str, body: dict[str, object], n: int, concurrency: int, tag: str = "l"
) -> list[Result]:
    """n requests, at most `concurrency` at once."""
    sem = asyncio.Semaphore(concurrency)
    with bar(n, "requests", unit="req", leave=False) as done:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> Result:
                async with sem:
                    r = await send_chat(s, url, body, f"{tag}{i}")
                done.update()
                return r

            return await asyncio.gather(*(one(i) for i in range(n)))


async def _throughput(url: str, body: dict[str, object], n: int, concurrency: int) -> float:
    t0 = time.perf_counter()
    results = await _concurrent(url, body, n, concurrency, "t")
    elapsed = time.perf_counter() - t0
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    return n / elapsed


def long_prompts(
    urls: tuple[str, str], n: int, tokens: int = 131_072, clients: int = 32
) -> list[str]:
    """`clients` concurrent clients sending `tokens`-token prompts, each proxy in turn
    (twice: envoy, gorgo, envoy, gorgo); TTFT p50/p99 and what gorgo adds."""
    body = chat_body(_prompt(tokens), 1)
    asyncio.run(_concurrent(urls[0], body, clients, clients))  # warm both
    asyncio.run(_concurrent(urls[1], body, clients, clients))
    got: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(2):
        for which in (0, 1):
            who = "envoy alone" if which == 0 else "envoy+gorgo"
            print(
                f"  {tokens // 1024}k-token prompts, {clients} clients, {who}...", file=sys.stderr
            )
            got[which] += _ttfts(asyncio.run(_concurrent(urls[which], body, n, clients)))
    e, g = got[0], got[1]
    return [
        f"{f'TTFT p{q} ms, {tokens // 1024}k tokens, {clients} clients':<34} "
        f"{percentile(e, q):>12.3f} {percentile(g, q):>12.3f} "
        f"{percentile(g, q) - percentile(e, q):>9.3f} {target:>8}"
        for q, target in ((50, ""), (99, f"<= {TARGET_LONG_P99_MS:g}"))
    ]


def _ttfts(rs: list[Result]) -> list[float]:
    bad = [r for r in rs if not r.ok or r.ttft_ms is None]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed, first: {bad[0].status} {bad[0].error}")
    return [r.ttft_ms for r in rs if r.ttft_ms is not None]


def _per_token_ms(rs: list[Result]) -> float:
    gaps = [(r.e2e_ms or 0) - (r.ttft_ms or 0) for r in rs]
    return percentile(gaps, 50) / max(1, rs[0].output_tokens - 1)


def paired_stack(
    policy: str = "round_robin",
    serve_args: tuple[str, ...] = (),
    otlp_endpoint: str = "",
    router_argv: tuple[str, ...] = (),
) -> tuple[Stack, tuple[str, str]]:
    """Envoy + gorgo and Envoy alone (the same generated config without ext_proc) in front
    of 3 zero-delay engines, started; returns the stack and (alone, gorgo) URLs.
    `otlp_endpoint`: where the router exports its decision spans ("": nowhere);
    `router_argv`: another program in the router's place (the floor, bench path)."""
    stack = _stack(policy, serve_args, flow_control=False, router_argv=router_argv)
    if otlp_endpoint:
        telemetry = replace(stack.config.telemetry, otlp_endpoint=otlp_endpoint)
        stack.config = replace(stack.config, telemetry=telemetry)
    front, admin = free_ports(2)
    alone = replace(
        stack.config,
        envoy=replace(stack.config.envoy, listen=f"127.0.0.1:{front}", admin=f"127.0.0.1:{admin}"),
    )
    stack.start()
    try:
        stack.start_envoy("envoy-alone", render_envoy_config(alone, ext_proc=False))
        _wait_ok(f"http://127.0.0.1:{admin}/ready")
    except BaseException:
        stack.stop()
        raise
    return stack, (f"http://127.0.0.1:{front}", stack.front_door_url)


def _stack(
    policy: str,
    serve_args: tuple[str, ...],
    flow_control: bool,
    router_argv: tuple[str, ...] = (),
) -> Stack:
    """`flow_control`: the router's gateway queue on (zero-delay engines: room everywhere)."""
    settings = StackSettings(
        policy=policy,
        regions=REGIONS,
        ports=StackPorts.ephemeral(len(REGIONS)),
        engine_args=("--zero-delay",),
        wan_links=False,
        # One worker per Envoy: two proxies, three engines, the router and the client
        # share two cores, and fewer threads make the tails less noisy for both.
        envoy_concurrency=1,
        serve_args=serve_args,
        router_argv=router_argv,
    )
    stack = Stack(settings)
    if flow_control:
        flow = replace(stack.config.flow_control, enabled=True)
        stack.config = replace(stack.config, flow_control=flow)
    return stack


def run_overhead_bench(
    requests: int = 200, long_only: bool = False, flow: bool = False, otlp: bool = False
) -> int:
    print("starting Envoy + gorgo and Envoy alone in front of 3 zero-delay engines...")
    otlp_port = free_ports(1)[0] if otlp else 0
    stack, urls = paired_stack(otlp_endpoint=f"127.0.0.1:{otlp_port}" if otlp else "")
    stacks = [stack]
    sink = None
    try:
        if flow:  # a second router, flow control on, in front of its own engines
            print("starting Envoy + gorgo with flow control on...")
            flow_stack = _stack("round_robin", (), flow_control=True)
            stacks.append(flow_stack)
            flow_stack.start()
        # after every process is forked (OtlpSink's docstring); the router's exporter
        # connects when it first exports
        sink = OtlpSink(otlp_port) if otlp else None
        if long_only:
            lines = [HEADER, *long_prompts(urls, max(64, requests // 2))]
        else:
            lines = _measure(urls, requests, stack.procs["gorgo-serve"].pid, sink)
            if flow:
                lines += ["", *_measure_flow((*urls, flow_stack.front_door_url), requests)]
    finally:
        for s in stacks:
            s.stop()
        if sink is not None:
            sink.stop()
    if sink is not None:
        lines.append(f"(decision spans exported to an OTLP receiver: {sink.spans})")
    print("\n".join(lines))
    return 0


def _mean_rates(urls: tuple[str, ...], n: int) -> list[float]:
    """Requests per second at concurrency 16 (1k-token prompts), each proxy in turn, twice
    (envoy, gorgo, ..., envoy, gorgo, ...: drift hits all alike); each proxy's mean."""
    body = chat_body(_prompt(1024), 16)
    rates: list[list[float]] = [[] for _ in urls]
    for _ in range(2):
        for which, url in enumerate(urls):
            rates[which].append(asyncio.run(_throughput(url, body, n * 2, 16)))
    return [sum(r) / len(r) for r in rates]


def _measure_flow(urls: tuple[str, ...], n: int) -> list[str]:
    """Envoy alone, gorgo, gorgo with flow control on (room everywhere): what the queue's
    check adds, in turn in the same run."""
    lines = [
        f"{'flow control on, room everywhere':<34} {'envoy alone':>12} {'envoy+gorgo':>12} "
        f"{'+flow ctl':>12} {'flow adds':>9}"
    ]
    for tokens in (1024, 32768):
        body = chat_body(_prompt(tokens), 1)
        asyncio.run(_rotate(urls, body, 10))
        print(f"  flow control, {tokens}-token prompt, {n} requests each...", file=sys.stderr)
        e, g, f = (_ttfts(rs) for rs in asyncio.run(_rotate(urls, body, n)))
        for q in (50, 99):
            pe, pg, pf = (percentile(x, q) for x in (e, g, f))
            lines.append(
                f"{f'TTFT p{q} ms, {tokens // 1024}k-token prompt':<34} {pe:>12.3f} {pg:>12.3f} "
                f"{pf:>12.3f} {pf - pg:>9.3f}"
            )
    re, rg, rf = _mean_rates(urls, n)
    lines.append(
        f"{'requests/s, concurrency 16':<34} {re:>12.1f} {rg:>12.1f} {rf:>12.1f} "
        f"{f'x{rf / rg:.3f}':>9}"
    )
    return lines


def wait_exported(sink: OtlpSink | None, spans: int) -> None:
    """Wait until the sink has `spans` (the router batches its exports, every 5 s): the
    phase's CPU then includes encoding and sending its spans."""
    deadline = time.monotonic() + 15.0
    while sink is not None and sink.spans < spans and time.monotonic() < deadline:
        time.sleep(0.05)


def cpu_phase(
    urls: tuple[str, str],
    body: dict[str, object],
    n: int,
    router_pid: int,
    sink: OtlpSink | None = None,
    routed: int = 0,
) -> tuple[Pair, float]:
    """10 requests to each proxy to warm connections and caches, then `n` each,
    alternating: their results and the router process's CPU (all its threads) per request
    over the `n`, read once the sink has their spans (`routed`: spans the router had sent
    it before; the wait's idle CPU is in it too)."""
    asyncio.run(_alternate(urls, body, 10))
    wait_exported(sink, routed + 10)
    cpu0_s = proc_cpu_s(router_pid)
    pair = asyncio.run(_alternate(urls, body, n))
    wait_exported(sink, routed + 10 + n)
    return pair, (proc_cpu_s(router_pid) - cpu0_s) * 1e3 / n


def _measure(
    urls: tuple[str, str], n: int, router_pid: int, sink: OtlpSink | None = None
) -> list[str]:
    lines = [HEADER]
    cpu_lines = []
    for i, tokens in enumerate((1024, 32768)):
        body = chat_body(_prompt(tokens), 1)
        print(f"  concurrency 1, {tokens}-token prompt, {n} requests each...", file=sys.stderr)
        pair, cpu_ms = cpu_phase(urls, body, n, router_pid, sink, i * (10 + n))
        tgt = f"<= {TARGET_CPU_MS:g}" if tokens == 1024 else ""
        cpu_lines.append(
            f"{f'router CPU ms/request, {tokens // 1024}k':<34} {'':>12} {cpu_ms:>12.3f} "
            f"{'':>9} {tgt:>8}"
        )
        e, g = _ttfts(pair.envoy), _ttfts(pair.gorgo)
        for q, target in ((50, TARGET_P50_MS), (99, TARGET_P99_MS)):
            pe, pg = percentile(e, q), percentile(g, q)
            tgt = f"<= {target:g}"
            lines.append(
                f"{f'TTFT p{q} ms, {tokens // 1024}k-token prompt':<34} {pe:>12.3f} {pg:>12.3f} "
                f"{pg - pe:>9.3f} {tgt:>8}"
            )

    lines += cpu_lines
    print("  concurrency 16 throughput...", file=sys.stderr)
    re, rg = _mean_rates(urls, n)
    lines.append(
        f"{'requests/s, concurrency 16':<34} {re:>12.1f} {rg:>12.1f} {f'x{rg / re:.3f}':>9} "
        f"{f'>= x{TARGET_THROUGHPUT_RATIO:g}':>8}"
    )

    print("  streamed tokens...", file=sys.stderr)
    body = chat_body(_prompt(64), 1000)
    pair = asyncio.run(_alternate(urls, body, max(10, n // 10)))
    te, tg = _per_token_ms(pair.envoy), _per_token_ms(pair.gorgo)
    lines.append(
        f"{'ms per token after the first':<34} {te:>12.4f} {tg:>12.4f} {tg - te:>9.4f} "
        f"{f'<= {TARGET_PER_TOKEN_MS:g}':>8}"
    )
    return lines


def _wait_ok(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


# -- the endpoint picker's streamed mode against the default ------------------------------

# Engines that decode one token every 8 ms (a real one takes 9-25 ms): each token leaves in
# a chunk of its own, as it would, and nothing else costs time.
DECODE_STEP_ENGINE = tuple(
    arg
    for setting in (
        "prefill_base_ms=1",
        "prefill_tokens_per_s=10000000",
        "decode_base_ms=8",
        "decode_batch_ms=0",
        "decode_per_request_ms=0",
        "decode_per_1k_context_ms=0",
    )
    for arg in ("--set", setting)
)
PICKER_STREAM_TOKENS = 64
# Each round first reads each router's idle CPU (probes, engine metrics, timers) over this
# long, and takes it out of the CPU per request, which is then the requests' own.
IDLE_S = 5.0


def _mode_stack(mode: str) -> Stack:
    settings = StackSettings(
        policy="round_robin",
        regions=REGIONS,
        ports=StackPorts.ephemeral(len(REGIONS)),
        engine_args=DECODE_STEP_ENGINE,
        wan_links=False,
        envoy_concurrency=1,
        envoy_mode=mode,
        tuner_mode="off",
    )
    stack = Stack(settings)
    # the chart's ORIGINAL_DST cluster takes one address
    envoy = replace(stack.config.envoy, connect_retries=0)
    stack.config = replace(stack.config, envoy=envoy)
    return stack


def run_picker_stream_bench(requests: int = 40, rounds: int = 3) -> int:
    """The router behind the extension's chart-like Envoy (both bodies FULL_DUPLEX_STREAMED:
    every chunk through the router) against the default front door (BUFFERED routing + the
    observing filter: the router sees the first chunk only), each with its own router and
    engines, requests alternating between them at concurrency 1; per round each router's
    CPU per request and the inter-token gaps the client sees; medians of the rounds."""
    from emulator.stack.gateway_envoy import gateway_envoy_config

    print("starting the default front door and the chart-like gateway, each with a router...")
    default, picker = _mode_stack("cluster"), _mode_stack("endpoint_picker")
    stacks: list[Stack] = []
    try:
        for s in (default, picker):
            stacks.append(s)
            s.start()
        front, admin = free_ports(2)
        grpc_port = int(picker.config.listen.grpc.rsplit(":", 1)[1])
        # plaintext to the picker as to the default router: the chunks' cost, not TLS's
        picker.start_envoy("gateway", gateway_envoy_config(front, admin, grpc_port, tls=False))
        _wait_ok(f"http://127.0.0.1:{admin}/ready")
        urls = (default.front_door_url, f"http://127.0.0.1:{front}")
        pids = (default.procs["gorgo-serve"].pid, picker.procs["gorgo-serve"].pid)
        rows = [_stream_round(urls, pids, requests, r) for r in range(rounds)]
    finally:
        for s in stacks:
            s.stop()
    print("\n".join(_stream_report(rows, requests)))
    return 0


def _stream_round(
    urls: tuple[str, str], pids: tuple[int, int], n: int, round_no: int
) -> dict[str, tuple[float, float]]:
    """One round: (default, streamed) router CPU ms/request beyond its idle CPU, ITL p50
    and p99 ms, TTFT p50."""
    body = chat_body(_prompt(1024), PICKER_STREAM_TOKENS)
    asyncio.run(_alternate(urls, body, 5))  # warm connections and caches
    print(f"  round {round_no + 1}: idle {IDLE_S:g} s, then {n} requests each...", file=sys.stderr)
    idle0, t0 = [proc_cpu_s(p) for p in pids], time.monotonic()
    time.sleep(IDLE_S)
    cpu0, t1 = [proc_cpu_s(p) for p in pids], time.monotonic()
    idle_rate = [(c - i) / (t1 - t0) for c, i in zip(cpu0, idle0, strict=True)]
    pair = asyncio.run(_alternate(urls, body, n))
    window_s = time.monotonic() - t1
    cpu = [
        (proc_cpu_s(p) - c - rate * window_s) * 1e3 / n
        for p, c, rate in zip(pids, cpu0, idle_rate, strict=True)
    ]
    results = (pair.envoy, pair.gorgo)
    for rs in results:
        _ttfts(rs)  # every request answered
        short = [r for r in rs if r.output_tokens != PICKER_STREAM_TOKENS]
        if short:
            raise RuntimeError(f"{len(short)} streams cut short, first: {short[0].error}")
    gaps = [[g for r in rs for g in r.itl_ms] for rs in results]
    ttft = [percentile(_ttfts(rs), 50) for rs in results]
    return {
        "cpu": (cpu[0], cpu[1]),
        "itl50": (percentile(gaps[0], 50), percentile(gaps[1], 50)),
        "itl99": (percentile(gaps[0], 99), percentile(gaps[1], 99)),
        "ttft50": (ttft[0], ttft[1]),
    }


def _stream_report(rows: list[dict[str, tuple[float, float]]], n: int) -> list[str]:
    def median(xs: list[float]) -> float:
        return percentile(xs, 50)

    lines = [
        f"{PICKER_STREAM_TOKENS} tokens a request (8 ms a token), {n} requests a mode a round, "
        f"{len(rows)} rounds: medians of the rounds",
        f"{'measurement':<34} {'default':>10} {'streamed':>10} {'added':>9} {'ratio':>7}",
    ]
    names = {
        "cpu": "router CPU ms/request, net",
        "ttft50": "TTFT p50 ms",
        "itl50": "inter-token p50 ms",
        "itl99": "inter-token p99 ms",
    }
    for key, name in names.items():
        base, streamed = median([r[key][0] for r in rows]), median([r[key][1] for r in rows])
        lines.append(
            f"{name:<34} {base:>10.3f} {streamed:>10.3f} {streamed - base:>9.3f} "
            f"{f'x{streamed / base:.2f}':>7}"
        )
    per_round = ", ".join(f"{r['cpu'][0]:.2f} / {r['cpu'][1]:.2f}" for r in rows)
    lines.append(f"(router CPU ms/request by round, default / streamed: {per_round})")
    added = median([r["cpu"][1] - r["cpu"][0] for r in rows])
    lines.append(
        f"(the streamed mode's added CPU, median of the rounds: {added:.2f} ms a request, "
        f"{added / PICKER_STREAM_TOKENS * 1e3:.0f} us a response chunk)"
    )
    return lines
