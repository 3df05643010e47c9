"""A fake Kubernetes API server with behaviour (no Kubernetes here): pods and
InferencePools in memory, a resource version that grows with every change, list and watch
of pods by label selector as the API server does them (JSON lines of ADDED / MODIFIED /
DELETED from a resource version, ERROR 410 for one that was compacted away, the watch
ending after timeoutSeconds), and a kubeconfig a client can load to reach it."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

POOL_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
LEASE_API = "coordination.k8s.io/v1"
LEASES_PATH = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
LEASE_PATH = LEASES_PATH + "/{name}"


def _matches(labels: Mapping[str, str], selector: str) -> bool:
    if not selector:
        return True
    return all(labels.get(k) == v for k, _, v in (p.partition("=") for p in selector.split(",")))


def pod(
    name: str,
    ip: str,
    labels: Mapping[str, str],
    ready: bool = True,
    namespace: str = "default",
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A pod object as the API returns it (the fields the picker reads)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(labels),
            "annotations": dict(annotations or {}),
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def inference_pool(
    name: str, labels: Mapping[str, str], ports: list[int], namespace: str = "default"
) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


class FakeKubeApi:
    """The API server's pods and pools, changed by the test, served over HTTP."""

    def __init__(self) -> None:
        self.version = 100
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.pools: dict[tuple[str, str], dict[str, Any]] = {}
        # coordination.k8s.io/v1 Leases (leader election): create, read, replace, with the
        # API server's optimistic concurrency (a stale resourceVersion is a 409).
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        # (resource version, event type, object) of every pod change; older ones compacted
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted_below = 0
        self.changed = asyncio.Event()
        self.requests: list[str] = []
        self.watches_open = 0
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.closing = False

    # -- what a test changes -----------------------------------------------------------

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def put_pod(self, obj: dict[str, Any]) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        kind = "MODIFIED" if key in self.pods else "ADDED"
        obj = self._bump(obj)
        self.pods[key] = obj
        self.log.append((self.version, kind, obj))
        self._wake()

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        obj = self._bump(self.pods.pop((namespace, name)))
        self.log.append((self.version, "DELETED", obj))
        self._wake()

    def put_pool(self, obj: dict[str, Any]) -> None:
        self.pools[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = self._bump(obj)

    def compact(self) -> None:
        """Forget the event history (etcd compaction): a watch from before gets 410."""
        self.compacted_below = self.version + 1
        self.log.clear()

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # -- HTTP ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.start_on(0)

    async def start_on(self, port: int) -> None:
        """Serve on `port` (0: a free one); again on the same one after `stop`."""
        self.closing = False
        app = web.Application()
        app.router.add_get(POOL_PATH, self._get_pool)
        app.router.add_get(PODS_PATH, self._pods)
        app.router.add_get(LEASE_PATH, self._get_lease)
        app.router.add_put(LEASE_PATH, self._put_lease)
        app.router.add_post(LEASES_PATH, self._post_lease)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop serving: open watches end (as when an API server goes away)."""
        self.closing = True
        self._wake()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def holder(self, name: str, namespace: str = "default") -> str | None:
        lease = self.leases.get((namespace, name))
        return None if lease is None else lease.get("spec", {}).get("holderIdentity")

    async def _get_lease(self, request: web.Request) -> web.Response:
        lease = self.leases.get((request.match_info["ns"], request.match_info["name"]))
        if lease is None:
            return _status(404, "NotFound", f'leases "{request.match_info["name"]}" not found')
        return web.json_response(lease)

    async def _post_lease(self, request: web.Request) -> web.Response:
        obj = await request.json()
        obj.setdefault("metadata", {})["namespace"] = request.match_info["ns"]
        key = (request.match_info["ns"], obj["metadata"]["name"])
        if key in self.leases:
            return _status(409, "AlreadyExists", f'leases "{key[1]}" already exists')
        self.leases[key] = self._bump({**obj, "apiVersion": LEASE_API, "kind": "Lease"})
        return web.json_response(self.leases[key], status=201)

    async def _put_lease(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        obj = await request.json()
        held = self.leases.get(key)
        if held is None:
            return _status(404, "NotFound", f'leases "{key[1]}" not found')
        if obj.get("metadata", {}).get("resourceVersion") != held["metadata"]["resourceVersion"]:
            return _status(409, "Conflict", "the object has been modified")
        obj["metadata"]["namespace"] = key[0]
        self.leases[key] = self._bump({**obj, "apiVersion": LEASE_API, "kind": "Lease"})
        return web.json_response(self.leases[key])

    def kubeconfig(self, path: Path) -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "epp", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "epp"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(doc))
        return path

    async def _get_pool(self, request: web.Request) -> web.Response:
        self.requests.append(f"GET pool {request.match_info['name']}")
        pool = self.pools.get((request.match_info["ns"], request.match_info["name"]))
        if pool is None:
            status = {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}
            return web.json_response(status, status=404)
        return web.json_response(pool)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        selector = request.query.get("labelSelector", "")
        # the API server parses it as Go's strconv.ParseBool does (the client sends "True")
        if request.query.get("watch") in ("1", "t", "T", "TRUE", "true", "True"):
            return await self._watch(request, ns, selector)
        self.requests.append(f"LIST pods {selector}")
        items = [
            p
            for (pns, _), p in sorted(self.pods.items())
            if pns == ns and _matches(p["metadata"]["labels"], selector)
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }
        )

    async def _watch(self, request: web.Request, ns: str, selector: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.version)
        timeout_s = float(request.query.get("timeoutSeconds") or 300)
        self.requests.append(f"WATCH pods {selector} from {since}")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since < self.compacted_below - 1:
            gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            await resp.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        sent = since
        self.watches_open += 1
        try:
            while True:
                for version, kind, obj in list(self.log):
                    meta = obj["metadata"]
                    if version <= sent or meta["namespace"] != ns:
                        continue
                    sent = version
                    if _matches(meta["labels"], selector):
                        line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                        await resp.write(line)
                left = deadline - loop.time()
                if left <= 0 or self.closing:
                    return resp
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    return resp
        finally:
            self.watches_open -= 1


def _status(code: int, reason: str, message: str) -> web.Response:
    """The API server's error answer (a metav1.Status)."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "reason": reason, "code": code}  # fmt: skip
    return web.json_response(body, status=code)
