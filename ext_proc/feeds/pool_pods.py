"""A Kubernetes pool's pods as backends: which pods and ports an InferencePool (or a label
selector) names, which of them can take requests, and the backends they make. Pure: the
objects are the API's JSON (as the watch delivers them); the watch is
ext_proc/service/loops/pool_watch.py.

The rules are the Gateway API Inference Extension's endpoint picker's (read in its code,
v1.5: pkg/epp/datastore/datastore.go, pkg/epp/util/pod/pod.go): a pod counts while its
Ready condition is True and it is not being deleted; each of the pool's target ports is an
endpoint `podIP:port`, named `<pod>-rank-<index>`; the annotation
`inference.networking.k8s.io/active-ports` narrows a pod to some of the ports.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
# A backend id is at most 63 characters (it names an Envoy cluster and a header value);
# a longer endpoint name keeps its start and a hash of the whole.
_MAX_ID = 63
_ID_CHARS = re.compile(r"[^a-z0-9_.-]")


@dataclass(frozen=True)
class PoolSpec:
    """Which pods (labels all of which they carry) and which of their ports."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector.items())

    @property
    def label_selector(self) -> str:
        """As the API's labelSelector query parameter."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """An InferencePool object's spec (v1: selector.matchLabels, targetPorts[].number).
    ValueError names what is missing."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or () if "number" in p)
    name = (pool.get("metadata") or {}).get("name", "?")
    if not labels:
        raise ValueError(f"InferencePool {name}: spec.selector.matchLabels is empty")
    if not ports:
        raise ValueError(f"InferencePool {name}: spec.targetPorts is empty")
    return PoolSpec(dict(labels), ports)


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True and not being deleted (the extension's IsPodReady)."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def endpoint_id(pod_name: str, rank: int) -> str:
    """The backend id of a pod's rank-th target port: the extension's endpoint name, made
    a valid backend id."""
    name = _ID_CHARS.sub("-", f"{pod_name}-rank-{rank}".lower())
    if len(name) <= _MAX_ID:
        return name
    digest = hashlib.blake2b(name.encode(), digest_size=6).hexdigest()
    return f"{name[: _MAX_ID - len(digest) - 1]}-{digest}"


def pod_endpoints(pod: Mapping[str, Any], spec: PoolSpec) -> dict[str, str]:
    """The pod's endpoints that can take requests now: backend id -> `podIP:port` (none
    if it is not ready, has no IP yet, or is not in the pool)."""
    meta = pod.get("metadata") or {}
    ip = (pod.get("status") or {}).get("podIP") or ""
    if not ip or not is_ready(pod) or not spec.selects(meta.get("labels") or {}):
        return {}
    active = _active_ports(meta.get("annotations") or {}, spec.target_ports)
    host = f"[{ip}]" if ":" in ip else ip
    return {
        endpoint_id(meta.get("name", ""), rank): f"{host}:{port}"
        for rank, port in enumerate(spec.target_ports)
        if port in active
    }


def _active_ports(annotations: Mapping[str, str], ports: tuple[int, ...]) -> set[int]:
    text = annotations.get(ACTIVE_PORTS_ANNOTATION)
    if text is None:
        return set(ports)
    listed = {int(p) for p in (s.strip() for s in text.split(",")) if p.isdigit()}
    return listed & set(ports)


class PoolPods:
    """The pool's pods as the watch has told them, and their endpoints now."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        # pod name -> its endpoints (backend id -> address)
        self.pods: dict[str, dict[str, str]] = {}

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full list (the watch's start, or after it lost its place)."""
        self.pods = {}
        for pod in pods:
            self.apply("ADDED", pod)

    def apply(self, event_type: str, pod: Mapping[str, Any]) -> bool:
        """One watch event (ADDED, MODIFIED, DELETED); returns whether the endpoints
        changed."""
        name = (pod.get("metadata") or {}).get("name", "")
        before = self.pods.get(name)
        now = {} if event_type == "DELETED" else pod_endpoints(pod, self.spec)
        if now:
            self.pods[name] = now
        else:
            self.pods.pop(name, None)
        return (before or {}) != now

    def endpoints(self) -> dict[str, str]:
        """Every endpoint: backend id -> address, in pod-name order."""
        return {bid: a for name in sorted(self.pods) for bid, a in self.pods[name].items()}
