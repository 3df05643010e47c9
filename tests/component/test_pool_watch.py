"""Backends from Kubernetes: the pool watch against a fake API server (list, watch, a
compacted watch, the pool's spec changing, the API server away), the router's fleet
following the pods as they come and go."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from ext_proc.config.load import config_from_dict
from ext_proc.core.build import build_router
from ext_proc.core.router import Router
from ext_proc.service.loops import pool_watch
from ext_proc.service.loops.pool_watch import PoolWatch
from ext_proc.vocab.types import BackendLifecycle
from tests.kube_api import FakeKubeApi, inference_pool, pod

pytestmark = pytest.mark.component

APP = {"app": "vllm"}


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    fake = FakeKubeApi()
    await fake.start()
    yield fake
    await fake.stop()


def router_for(kube: dict[str, Any], kubeconfig: Path, **extra: Any) -> Router:
    cfg = config_from_dict(
        {
            "policy": "least_request",
            "envoy": {"mode": "endpoint_picker"},
            "discovery": {
                "kubernetes": {**kube, "kubeconfig": str(kubeconfig)},
                "backend": {"engine": "sglang", "region": "pool"},
            },
            **extra,
        }
    )
    return build_router(cfg, time.monotonic, random.Random(0))


def active(router: Router) -> dict[str, str]:
    return {
        b: st.config.address
        for b, st in router.backends.items()
        if st.lifecycle is BackendLifecycle.ACTIVE
    }


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_an_inference_pools_pods_become_backends_as_they_come_and_go(
    api: FakeKubeApi, tmp_path: Path
) -> None:
    api.put_pool(inference_pool("llama", APP, [8000]))
    api.put_pod(pod("vllm-0", "10.0.0.1", APP))
    api.put_pod(pod("vllm-1", "10.0.0.2", APP, ready=False))
    api.put_pod(pod("other", "10.0.0.9", {"app": "other"}))
    router = router_for({"pool_name": "llama"}, api.kubeconfig(tmp_path / "kubeconfig"))
    watch = PoolWatch(router.cfg, router)
    await watch.start()
    try:
        await until(lambda: watch.synced)
        assert active(router) == {"vllm-0-rank-0": "10.0.0.1:8000"}
        record = router.backends["vllm-0-rank-0"]
        assert (record.config.engine, record.config.region) == ("sglang", "pool")
        # ready now: it joins
        api.put_pod(pod("vllm-1", "10.0.0.2", APP))
        await until(lambda: "vllm-1-rank-0" in active(router))
        # a new pod, then one going away: the fleet follows
        api.put_pod(pod("vllm-2", "10.0.0.3", APP))
        api.delete_pod("vllm-0")
        await until(lambda: set(active(router)) == {"vllm-1-rank-0", "vllm-2-rank-0"})
        assert "vllm-0-rank-0" not in router.backends  # drained, nothing in flight: gone
        # the pool may shrink to none (no backend to keep: the picker answers 503)
        api.delete_pod("vllm-1")
        api.delete_pod("vllm-2")
        await until(lambda: active(router) == {})
        snap = watch.snapshot()
        assert snap["synced"] and snap["endpoints"] == {} and snap["lists"] == 1
        assert snap["source"] == "InferencePool default/llama"
    finally:
        await watch.stop()
    # one list, then watches from its resource version
    assert api.requests[:3] == [
        "GET pool llama",
        "LIST pods app=vllm",
        "WATCH pods app=vllm from 104",
    ]


async def test_a_label_selector_and_ports_without_a_pool(api: FakeKubeApi, tmp_path: Path) -> None:
    api.put_pod(pod("sg-0", "10.1.0.1", {"app": "sg", "env": "prod"}))
    api.put_pod(pod("sg-1", "10.1.0.2", {"app": "sg", "env": "dev"}))
    kube = {"endpoint_selector": "app=sg,env=prod", "target_ports": [30000, 30001]}
    router = router_for(kube, api.kubeconfig(tmp_path / "kubeconfig"))
    watch = PoolWatch(router.cfg, router)
    await watch.start()
    try:
        await until(lambda: watch.synced)
        assert active(router) == {
            "sg-0-rank-0": "10.1.0.1:30000",
            "sg-0-rank-1": "10.1.0.1:30001",
        }
    finally:
        await watch.stop()


async def test_a_compacted_watch_lists_again_and_misses_nothing(
    api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.put_pool(inference_pool("llama", APP, [8000]))
    api.put_pod(pod("a", "10.0.0.1", APP))
    router = router_for({"pool_name": "llama"}, api.kubeconfig(tmp_path / "kubeconfig"))
    monkeypatch.setattr(pool_watch, "WATCH_TIMEOUT_S", 1)  # the server ends each watch soon
    watch = PoolWatch(router.cfg, router)
    await watch.start()
    try:
        await until(lambda: watch.synced and api.watches_open == 1)
        await api.stop()  # the API server goes away; a pod comes meanwhile
        api.put_pod(pod("b", "10.0.0.2", APP))
        api.compact()  # and the history with it: the old resource version is gone
        await api.start_on(api.port)
        await until(lambda: set(active(router)) == {"a-rank-0", "b-rank-0"}, timeout_s=10)
        assert watch.lists >= 2  # listed again after the 410
    finally:
        await watch.stop()


async def test_the_pools_ports_changing_lists_again(
    api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_watch, "POOL_POLL_S", 0.05)
    api.put_pool(inference_pool("llama", APP, [8000]))
    api.put_pod(pod("a", "10.0.0.1", APP))
    router = router_for({"pool_name": "llama"}, api.kubeconfig(tmp_path / "kubeconfig"))
    watch = PoolWatch(router.cfg, router)
    await watch.start()
    try:
        await until(lambda: active(router) == {"a-rank-0": "10.0.0.1:8000"})
        api.put_pool(inference_pool("llama", APP, [9000]))
        await until(lambda: active(router) == {"a-rank-0": "10.0.0.1:9000"})
    finally:
        await watch.stop()


async def test_a_missing_pool_is_retried_and_said(
    api: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_watch, "RETRY_MIN_S", 0.05)
    router = router_for({"pool_name": "nope"}, api.kubeconfig(tmp_path / "kubeconfig"))
    watch = PoolWatch(router.cfg, router)
    await watch.start()
    try:
        await until(lambda: "404" in watch.error)
        assert not watch.synced and active(router) == {}
        api.put_pool(inference_pool("nope", APP, [8000]))
        api.put_pod(pod("a", "10.0.0.1", APP))
        await until(lambda: watch.synced and "a-rank-0" in active(router))
        assert watch.error == ""
    finally:
        await watch.stop()
