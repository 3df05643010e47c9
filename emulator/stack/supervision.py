"""Keeping the local stack's children up: readiness waits, and `SupervisedChildren`, which
restarts a child that dies (routers from a warm spare) under emulator/stack/supervisor.py's
policy.

`gorgo up` restarts a child that dies, with exactly the argv (so the ports and config) it
had, while the others keep serving: Envoy fails open while the router is down, and the
router's probes and ejection keep requests off an engine or link that is down until it is
back. The policy (backoff, crash loop) is emulator/stack/supervisor.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from emulator.stack.processes import Children, Spawn, StackError, terminate
from emulator.stack.supervisor import GiveUp, RestartPolicy, Supervisor


def wait_port(port: int, deadline: float) -> None:
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise StackError(f"port {port} not accepting connections") from None
            time.sleep(0.05)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass(frozen=True)
class ChildRestart:
    """One restart the supervisor made: `attempt`-th in a row, new `pid`, when (monotonic)."""

    name: str
    attempt: int
    pid: int
    at_s: float


def _exit_how(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


def _say(line: str) -> None:
    print(f"gorgo up: {line}", file=sys.stderr, flush=True)


class SupervisedChildren(Children):
    """Children restarted when they die, by tend() (`gorgo up`'s main loop) or by
    supervise() (a background thread)."""

    # A router restarts from a warm spare (emulator/stack/spare.py): a process that has imported
    # it already and waits to become it, so a restarted router is up in well under a
    # second instead of a Python start-up (1.5 s idle here, 2-8 s on two busy cores), and
    # Envoy's fail-open spell is about the backoff. Only the routers: an engine's or a
    # link's restart waits on probes and ejection anyway. The spare starts once its child
    # has run SPARE_AFTER_S, so it never competes with a start-up for the CPU.
    SPARE_PRELOAD = {"ext_proc.cli": ("ext_proc.service.app",)}
    SPARE_FOR = "gorgo-serve"  # children whose name ends so
    SPARE_AFTER_S = 3.0

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.supervisor = Supervisor()
        self.supervised = False
        self.restarts: list[ChildRestart] = []
        self.supervisor_error: StackError | None = None
        self._tending: threading.Thread | None = None
        self._stop_tending = threading.Event()
        self._spares: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}

    def _adopt(self, name: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        super()._adopt(name, proc, log)
        self.supervisor.started(name, self._started_s[name])

    def _drop(self, name: str) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        dropped = super()._drop(name)
        self.supervisor.forget(name)  # stopped on purpose: no restart
        return dropped

    def stop(self) -> None:
        self._stop_supervising()  # first: nothing restarts what is being stopped
        super().stop()

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
            f"{p.window_s:g} s are a crash loop, which stops the stack, except for a router: "
            f"it is restarted every {p.backoff_max_s:g} s while Envoy fails open; routers "
            "restart from a warm spare"
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
                if decision.loop_began:
                    p = self.supervisor.policy
                    _say(
                        f"{name} exited ({how}) after {p.max_restarts} restarts within "
                        f"{p.window_s:g} s: a crash loop. A router is never given up on: it "
                        f"is restarted every {decision.delay_s:g} s until it starts (fix "
                        "what its log says), while Envoy fails open and the engines stay up. "
                        f"The last lines of {self.workdir / f'{name}.log'}:\n{self.log_tail(name)}"
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
            for name in self.supervisor.recovered(time.monotonic()):
                _say(f"{name} is out of its crash loop: it has run since its last restart")
            self._keep_spares()

    def _stop_supervising(self) -> None:
        self._stop_tending.set()
        if self._tending is not None:
            self._tending.join(timeout=30)
            self._tending = None
        terminate([spare for spare, _ in self._spares.values()], timeout_s=5)
        for _, log in self._spares.values():
            log.close()
        self._spares.clear()

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

    def _start_spare(self, name: str, spec: Spawn) -> None:
        preload = [f"--preload={m}" for m in self.SPARE_PRELOAD[spec.argv[2]]]
        argv = (sys.executable, "-m", "emulator.stack.spare", *preload, *spec.argv[2:])
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
        self._adopt(name, spare, log)
        return True

    def _wait_ok(self, url: str, deadline: float, what: str) -> None:
        """Until `url` answers 200; a child that died or the deadline raises StackError."""
        while not http_ok(url):
            self._check_alive()
            if time.monotonic() > deadline:
                raise StackError(f"{what} not ready in time: {url} (logs in {self.workdir})")
            time.sleep(0.05)
