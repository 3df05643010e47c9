"""A Kubernetes pool's pods as endpoints, by the endpoint picker's rules."""

from __future__ import annotations

import pytest

from ext_proc.feeds.pool_pods import (
    ACTIVE_PORTS_ANNOTATION,
    PoolPods,
    PoolSpec,
    endpoint_id,
    pod_endpoints,
    pool_spec,
)
from tests.kube_api import inference_pool, pod

APP = {"app": "vllm"}
SPEC = PoolSpec(APP, (8000,))


def test_an_inference_pool_names_its_selector_and_ports() -> None:
    spec = pool_spec(inference_pool("p", {"app": "vllm", "tier": "a"}, [8000, 8001]))
    assert spec == PoolSpec({"app": "vllm", "tier": "a"}, (8000, 8001))
    assert spec.label_selector == "app=vllm,tier=a"


@pytest.mark.parametrize("broken", ["selector", "targetPorts"])
def test_a_pool_without_selector_or_ports_is_refused_by_name(broken: str) -> None:
    pool = inference_pool("mine", APP, [8000])
    del pool["spec"][broken]
    with pytest.raises(ValueError, match=f"InferencePool mine: spec.{broken}"):
        pool_spec(pool)


def test_a_ready_pod_is_one_endpoint_per_target_port() -> None:
    spec = PoolSpec(APP, (8000, 8002))
    assert pod_endpoints(pod("vllm-0", "10.0.0.5", APP), spec) == {
        "vllm-0-rank-0": "10.0.0.5:8000",
        "vllm-0-rank-1": "10.0.0.5:8002",
    }


def test_pods_that_cannot_take_requests_are_no_endpoints() -> None:
    unready = pod("a", "10.0.0.1", APP, ready=False)
    no_ip = pod("b", "", APP)
    other = pod("c", "10.0.0.3", {"app": "sglang"})
    deleting = pod("d", "10.0.0.4", APP)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-05T10:00:00Z"
    no_conditions = pod("e", "10.0.0.5", APP)
    no_conditions["status"]["conditions"] = []
    for p in (unready, no_ip, other, deleting, no_conditions):
        assert pod_endpoints(p, SPEC) == {}, p["metadata"]["name"]


def test_the_active_ports_annotation_narrows_a_pod_to_some_ports() -> None:
    spec = PoolSpec(APP, (8000, 8001, 8002))
    p = pod("x", "10.0.0.9", APP, annotations={ACTIVE_PORTS_ANNOTATION: "8002, 8000,9999"})
    assert pod_endpoints(p, spec) == {"x-rank-0": "10.0.0.9:8000", "x-rank-2": "10.0.0.9:8002"}


def test_an_ipv6_pod_is_bracketed() -> None:
    assert pod_endpoints(pod("v6", "fd00::7", APP), SPEC) == {"v6-rank-0": "[fd00::7]:8000"}


def test_endpoint_ids_are_valid_backend_ids_however_long_the_pod_name() -> None:
    from ext_proc.config.load import _BACKEND_ID

    long = "llama-3-70b-instruct-" + "x" * 60 + "-7d9f8b6c5d-abcde"
    ids = {endpoint_id(long, 0), endpoint_id(long, 1), endpoint_id("Pod.One", 0)}
    assert len(ids) == 3
    assert all(_BACKEND_ID.match(i) and len(i) <= 63 for i in ids), ids


def test_pool_pods_follow_the_watch_events() -> None:
    pods = PoolPods(SPEC)
    pods.replace([pod("b", "10.0.0.2", APP), pod("a", "10.0.0.1", APP, ready=False)])
    assert pods.endpoints() == {"b-rank-0": "10.0.0.2:8000"}
    assert pods.apply("MODIFIED", pod("a", "10.0.0.1", APP))  # became ready
    assert list(pods.endpoints()) == ["a-rank-0", "b-rank-0"]
    assert not pods.apply("MODIFIED", pod("a", "10.0.0.1", APP))  # nothing new
    assert pods.apply("MODIFIED", pod("b", "10.0.0.2", APP, ready=False))
    assert pods.apply("DELETED", pod("a", "10.0.0.1", APP))
    assert pods.endpoints() == {}
    assert not pods.apply("DELETED", pod("zz", "10.0.0.9", APP))  # never had endpoints
