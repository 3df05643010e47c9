"""Backends from Kubernetes (`discovery.kubernetes`): the pods of an InferencePool or of a
label selector, listed and then watched through the API server with the kubernetes_asyncio
client; each change makes the router's fleet the configured backends plus one backend per
ready pod and target port (ext_proc/feeds/pool_pods.py says which). A pod that goes is
drained (its requests in flight finish), one that comes is added; the fleet may shrink to
none (then the router answers 503 in endpoint-picker mode, and is not ready).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ext_proc.common.aio import cancel_and_wait
from ext_proc.config.discovery import KubernetesDiscovery
from ext_proc.config.load import parse_selector
from ext_proc.config.schema import Config
from ext_proc.core.router import Router
from ext_proc.feeds.pool_pods import PoolPods, PoolSpec, pool_spec
from ext_proc.vocab.backend import Backend

if TYPE_CHECKING:  # the client is imported when discovery starts (~0.25 s of imports)
    from kubernetes_asyncio import client

log = logging.getLogger("gorgo.discovery")

# The API server ends a watch after this long (the client then watches on from where it
# was): short enough that a silently dropped connection is noticed within minutes.
WATCH_TIMEOUT_S = 300
# The InferencePool's spec (its selector, its ports) is read again this often: it changes
# rarely, and a change re-lists the pods.
POOL_POLL_S = 10.0
# After an error (API server away, RBAC refusal), try again after 1 s, doubling to 30 s.
RETRY_MIN_S, RETRY_MAX_S = 1.0, 30.0
# The InferencePool's API version the extension serves.
POOL_VERSION = "v1"


def namespace_of(k8s: KubernetesDiscovery) -> str:
    """The configured namespace, else the pod's own (the chart's NAMESPACE variable)."""
    return k8s.namespace or os.environ.get("NAMESPACE", "") or "default"


async def api_client(k8s: KubernetesDiscovery) -> client.ApiClient:
    """An API client: the kubeconfig named, else in-cluster (the pod's service account)
    when running in a pod, else $KUBECONFIG or ~/.kube/config."""
    from kubernetes_asyncio import client, config

    conf = client.Configuration()
    if k8s.kubeconfig:
        await config.load_kube_config(config_file=k8s.kubeconfig, client_configuration=conf)
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
    else:
        await config.load_kube_config(client_configuration=conf)
    return client.ApiClient(configuration=conf)


class PoolWatch:
    """The pool's pods, listed then watched; the fleet reconciled at each change."""

    name = "kubernetes"

    def __init__(
        self,
        cfg: Config,
        router: Router,
        connect: Callable[[KubernetesDiscovery], Any] = api_client,
    ) -> None:
        self.k8s = cfg.discovery.kubernetes
        self.template = cfg.discovery.backend
        # The backends of the config file, kept beside the discovered ones.
        self.static = tuple(cfg.backends)
        self.router = router
        self.connect = connect
        self.namespace = namespace_of(self.k8s)
        self.pods: PoolPods | None = None
        # True once the pods were listed (the router may call itself ready).
        self.synced = False
        self.error = ""
        self.lists = self.events = 0
        self._task: asyncio.Task[None] | None = None

    # -- what the service reads ------------------------------------------------------------

    def discovered(self) -> list[Backend]:
        """The backends the pods make now (a config reload keeps them)."""
        if self.pods is None:
            return []
        return [self.template.backend(b, a) for b, a in self.pods.endpoints().items()]

    def snapshot(self) -> dict[str, Any]:
        return {
            "source": f"InferencePool {self.namespace}/{self.k8s.pool_name}"
            if self.k8s.pool_name
            else f"pods {self.namespace}/{self.k8s.endpoint_selector}",
            "synced": self.synced,
            "endpoints": self.pods.endpoints() if self.pods is not None else {},
            "lists": self.lists,
            "events": self.events,
            "error": self.error,
        }

    # -- the loop --------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait([t for t in (self._task,) if t is not None])

    async def _run(self) -> None:
        retry_s = RETRY_MIN_S
        while True:
            try:
                api = await self.connect(self.k8s)
                try:
                    while True:  # each round: list, then watch until the list is stale
                        await self._round(api)
                        retry_s = RETRY_MIN_S
                finally:
                    await api.close()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the API server away, RBAC, a bad object: retry
                self.error = f"{type(e).__name__}: {e}"
                log.warning("kubernetes discovery: %s; again in %.0f s", self.error, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(RETRY_MAX_S, retry_s * 2)

    async def _spec(self, api: client.ApiClient) -> PoolSpec:
        if not self.k8s.pool_name:
            key = "discovery.kubernetes.endpoint_selector"
            return PoolSpec(parse_selector(self.k8s.endpoint_selector, key), self.k8s.target_ports)
        from kubernetes_asyncio import client

        pool = await client.CustomObjectsApi(api).get_namespaced_custom_object(
            self.k8s.pool_group, POOL_VERSION, self.namespace, "inferencepools", self.k8s.pool_name
        )
        return pool_spec(pool)

    async def _round(self, api: client.ApiClient) -> None:
        """List the pods, then follow them until the watch loses its place (410), the pool's
        spec changes, or the watch fails."""
        from kubernetes_asyncio import client

        spec = await self._spec(api)
        core = client.CoreV1Api(api)
        listed = await core.list_namespaced_pod(self.namespace, label_selector=spec.label_selector)
        pods = PoolPods(spec)
        pods.replace(api.sanitize_for_serialization(p) for p in listed.items)
        self.pods = pods
        self.lists += 1
        self._reconcile("listed")
        self.synced = True
        self.error = ""
        watcher = asyncio.create_task(self._watch(core, spec, listed.metadata.resource_version))
        poller = asyncio.create_task(self._spec_changed(api, spec))
        try:
            done, _ = await asyncio.wait((watcher, poller), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # its error, if it failed
        finally:
            await cancel_and_wait([watcher, poller])

    async def _watch(self, core: client.CoreV1Api, spec: PoolSpec, version: str) -> None:
        """Apply the pods' events until the list must be read again."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        while True:
            async with watch.Watch() as w:
                try:
                    stream = w.stream(
                        core.list_namespaced_pod,
                        self.namespace,
                        label_selector=spec.label_selector,
                        resource_version=version,
                        timeout_seconds=WATCH_TIMEOUT_S,
                        allow_watch_bookmarks=True,
                    )
                    async for event in stream:
                        self.events += 1
                        kind = event["type"]
                        pods = self.pods
                        if kind != "BOOKMARK" and pods and pods.apply(kind, event["raw_object"]):
                            self._reconcile(kind.lower())
                except ApiException as e:
                    if e.status == 410:  # our place is gone: list again
                        return
                    raise
                version = w.resource_version or version

    async def _spec_changed(self, api: client.ApiClient, spec: PoolSpec) -> None:
        """Return when the pool's selector or ports change (never for a label selector)."""
        while True:
            await asyncio.sleep(POOL_POLL_S)
            if not self.k8s.pool_name:
                continue
            if await self._spec(api) != spec:
                log.info("kubernetes discovery: the InferencePool changed: listing again")
                return

    def _reconcile(self, why: str) -> None:
        started = time.monotonic()
        changes = self.router.fleet.reconcile(
            [*self.static, *self.discovered()], "kubernetes", keep_one=False
        )
        if changes:
            log.info(
                "kubernetes discovery (%s): added %s, back %s, updated %s, draining %s (%.1f ms)",
                why,
                list(changes.added),
                list(changes.reactivated),
                list(changes.updated),
                list(changes.draining),
                (time.monotonic() - started) * 1000,
            )
