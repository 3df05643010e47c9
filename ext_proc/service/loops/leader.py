"""Active-passive `gorgo epp` replicas (`discovery.kubernetes.leader_election`, the
extension's `--ha-enable-leader-election`): the replicas contend for a
coordination.k8s.io/v1 Lease with kubernetes_asyncio's leader election (LeaseLock), and
only its holder calls itself ready. As the extension's own picker does
(cmd/epp/runner/health.go): the readiness probe and the ext_proc service's health pass on
the leader alone, liveness on every replica, so the Service sends Envoy to the leader and
the others wait, warm, to take over once its Lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.discovery import KubernetesDiscovery
from ext_proc.config.schema import Config
from ext_proc.service.loops.pool_watch import api_client, namespace_of

log = logging.getLogger("gorgo.leader")


def lease_name(k8s: KubernetesDiscovery) -> str:
    return k8s.leader_election.lease_name or f"gorgo-epp-{k8s.pool_name or 'pods'}"


def default_identity() -> str:
    """This replica's name on the Lease: its pod's (the host name) and process id."""
    return f"{socket.gethostname()}_{os.getpid()}"


class LeaderLease:
    """Whether this replica holds the Lease (`leading`); always True with leader
    election off, so readiness is as before."""

    name = "leader_election"

    def __init__(
        self,
        cfg: Config,
        connect: Callable[[KubernetesDiscovery], Any] = api_client,
        identity: str = "",
    ) -> None:
        self.k8s = cfg.discovery.kubernetes
        self.le = self.k8s.leader_election
        self.connect = connect
        self.identity = identity or default_identity()
        self.leading = not self.le.enabled
        self.elected = 0  # times this replica became the leader
        self.error = ""
        # Told when `leading` changes (the health service re-checks readiness at once).
        self.on_change: Callable[[], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._api: Any = None

    async def start(self) -> None:
        if self.le.enabled:
            self._tasks.append(asyncio.create_task(self._run()))

    async def stop(self) -> None:
        """Stop contending; a leader hands the Lease back (holder cleared), so a standby
        takes it at its next try instead of after lease_duration_s, as controller-runtime
        does with LeaderElectionReleaseOnCancel (which the extension's picker sets)."""
        leading = self.leading and self.le.enabled
        await cancel_and_wait(self._tasks)
        api, self._api = self._api, None
        if api is None:
            return
        try:
            if leading:
                await self._release(api)
        finally:
            with contextlib.suppress(Exception):
                await api.close()

    async def _release(self, api: Any) -> None:
        from kubernetes_asyncio import client

        name, ns = lease_name(self.k8s), namespace_of(self.k8s)
        try:
            coordination = client.CoordinationV1Api(api_client=api)
            lease = await coordination.read_namespaced_lease(name, ns)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return  # no longer ours
            lease.spec.holder_identity = None  # type: ignore[assignment]  # it is optional
            await coordination.replace_namespaced_lease(name, ns, lease)
            log.info("leader election: %s released %s", self.identity, name)
        except Exception as e:  # a stale resourceVersion, the API server gone: it expires
            log.warning("leader election: could not release %s: %s", name, e)

    def snapshot(self) -> dict[str, Any]:
        return {
            "enabled": self.le.enabled,
            "lease": f"{namespace_of(self.k8s)}/{lease_name(self.k8s)}",
            "identity": self.identity,
            "leading": self.leading,
            "elected": self.elected,
            "error": self.error,
        }

    async def _run(self) -> None:
        from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
        from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

        api = self._api = await self.connect(self.k8s)
        # (the client is closed by stop(), after the Lease is handed back)
        lock = LeaseLock(lease_name(self.k8s), namespace_of(self.k8s), self.identity, api)
        while True:  # a leader that lost the Lease becomes a candidate again
            config = electionconfig.Config(
                lock,
                lease_duration=self.le.lease_duration_s,
                renew_deadline=self.le.renew_deadline_s,
                retry_period=self.le.retry_period_s,
                onstarted_leading=self._lead,
                onstopped_leading=self._follow,
            )
            try:
                await leaderelection.LeaderElection(config).run()
            except Exception as e:  # the API server gone, a bad answer: try again
                self.error = str(e)
                log.warning("leader election: %s; again in %.0f s", e, self.le.retry_period_s)
            self._set(False)
            await asyncio.sleep(self.le.retry_period_s)

    def _set(self, leading: bool) -> None:
        changed, self.leading = leading != self.leading, leading
        if changed and self.on_change is not None:
            self.on_change()

    async def _lead(self) -> None:
        self.error = ""
        self.elected += 1
        self._set(True)
        log.info("leader election: %s holds %s: serving", self.identity, lease_name(self.k8s))

    async def _follow(self) -> None:
        self._set(False)
        log.warning("leader election: %s lost %s: not ready", self.identity, lease_name(self.k8s))
