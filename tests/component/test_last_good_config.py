"""A real `gorgo serve --last-good-config` (issue 39, point 4): it keeps a copy of the
config it runs, starts from that copy when its file is broken (the error named on /state
and in the log), takes the file back once fixed; without a copy a broken file still
fails the start (exit 2)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
# Addresses nothing listens on: the router's probes simply fail.
ADDRESSES = ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"]
BROKEN = "backends:\n  - id: a\n    address: no-port\n"


def doc(ids: str) -> str:
    return yaml.safe_dump(
        {
            "listen": {"grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
            "backends": [{"id": b, "address": a} for b, a in zip(ids, ADDRESSES, strict=False)],
        }
    )


class Serve:
    """One `gorgo serve` child; its output collected, its admin URL from the ready line."""

    def __init__(self, config: Path, last_good: Path | None) -> None:
        argv = [sys.executable, "-m", "ext_proc.cli", "serve", "--config", str(config)]
        if last_good is not None:
            argv += ["--last-good-config", str(last_good)]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lines: list[str] = []
        self.url = ""

    def ready(self) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if "gorgo serve: ready" in line:
                port = re.search(r"admin http://[\d.]+:(\d+)/state", line)
                assert port, line
                self.url = f"http://127.0.0.1:{port.group(1)}"
                return line
        raise AssertionError("not ready: " + "".join(self.lines))

    def state(self) -> Any:
        with urllib.request.urlopen(f"{self.url}/state", timeout=5) as r:
            return json.load(r)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.exited()

    def exited(self) -> str:
        out, _ = self.proc.communicate(timeout=30)
        return "".join(self.lines) + out


@pytest.fixture
def serves() -> Iterator[Callable[[Path, Path | None], Serve]]:
    started: list[Serve] = []

    def start(config: Path, last_good: Path | None) -> Serve:
        started.append(Serve(config, last_good))
        return started[-1]

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_a_broken_file_at_start_runs_the_last_good_config_until_it_is_fixed(
    serves: Callable[[Path, Path | None], Serve], tmp_path: Path
) -> None:
    config, last_good = tmp_path / "gorgo.yaml", tmp_path / "last-good.yaml"
    config.write_text(doc("abc"))
    first = serves(config, last_good)
    first.ready()
    assert last_good.read_text() == doc("abc")  # written once started
    assert first.state()["config"] == {
        "path": str(config),
        "source": "file",
        "error": None,
        "last_good": str(last_good),
    }
    # An accepted reload is the last good config from then on; a refused one is not.
    config.write_text(doc("ab"))
    first.proc.send_signal(signal.SIGHUP)
    until(lambda: last_good.read_text() == doc("ab"))
    config.write_text(BROKEN)
    first.proc.send_signal(signal.SIGHUP)
    until(lambda: first.state()["reload"]["failures"] >= 1)
    assert last_good.read_text() == doc("ab")
    first.proc.kill()  # a crash, with the broken file on disk
    first.proc.wait()

    second = serves(config, last_good)
    ready = second.ready()
    assert f"from the last good config {last_good}" in ready
    log = "".join(second.lines)
    assert f"config {config} does not load" in log and "backends[0].address" in log
    state = second.state()
    assert set(state["backends"]) == {"a", "b"}
    assert state["config"]["source"] == "last-good"
    assert str(config) in state["config"]["error"]
    assert "backends[0].address: expected host:port" in state["config"]["error"]
    # Still broken on SIGHUP: refused, the last good config runs on.
    second.proc.send_signal(signal.SIGHUP)
    until(lambda: second.state()["reload"]["failures"] >= 1)
    assert second.state()["config"]["source"] == "last-good"
    # Fixed (the watcher sees the file change): the file's config runs, and is kept.
    config.write_text(doc("abc"))
    until(lambda: second.state()["config"]["source"] == "file")
    state = second.state()
    assert set(state["backends"]) == {"a", "b", "c"} and state["config"]["error"] is None
    assert last_good.read_text() == doc("abc")
    out = second.stop()
    assert second.proc.returncode == 0, out


def test_without_a_last_good_copy_a_broken_file_fails_the_start(
    serves: Callable[[Path, Path | None], Serve], tmp_path: Path
) -> None:
    config, last_good = tmp_path / "gorgo.yaml", tmp_path / "last-good.yaml"
    config.write_text(BROKEN)
    for copy in (None, last_good):  # no flag; the flag but no file there yet
        serve = serves(config, copy)
        out = serve.exited()
        assert serve.proc.returncode == 2, out
        assert "backends[0].address: expected host:port" in out
    assert not last_good.exists()
    last_good.write_text("not: [valid")  # a copy that does not load either
    serve = serves(config, last_good)
    out = serve.exited()
    assert serve.proc.returncode == 2 and "backends[0].address" in out, out
