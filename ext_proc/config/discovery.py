"""The `discovery:` section: backends found at run time instead of listed under
`backends:`. Today one source: the model-server pods of a Kubernetes InferencePool (the
Gateway API Inference Extension's resource) or of a label selector, as the extension's
endpoint picker finds them; each ready pod's target port becomes a backend made from
`discovery.backend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ext_proc.vocab.backend import (
    DEFAULT_PROFILE,
    Backend,
    EngineKind,
    KvEventsSource,
    PriorityScheduling,
)
from ext_proc.vocab.params import NON_NEGATIVE, POSITIVE, bounded

# The InferencePool's API group the extension serves (v1, inference.networking.k8s.io).
POOL_GROUP = "inference.networking.k8s.io"


@dataclass(frozen=True)
class LeaderElection:
    """The Lease the replicas contend for (service.loops.leader): controller-runtime's
    default timings, which the extension's own picker uses."""

    enabled: bool = False
    # The Lease's name in the pods' namespace; "" = gorgo-epp-<pool name or "pods">.
    lease_name: str = ""
    # A holder that stops renewing loses the Lease this long after its last renewal; it
    # gives up leading when it could not renew for renew_deadline_s; candidates try
    # every retry_period_s (the library wants lease > renew > 1.2 x retry, each >= 1).
    lease_duration_s: int = bounded(15, **POSITIVE)  # the Lease's leaseDurationSeconds
    renew_deadline_s: float = bounded(10.0, **POSITIVE)
    retry_period_s: float = bounded(2.0, **POSITIVE)


@dataclass(frozen=True)
class KubernetesDiscovery:
    """Where the pool's pods are: an InferencePool by name (its selector and target
    ports), or a label selector and ports given here (the extension's standalone mode)."""

    # The pods' namespace; "" = the NAMESPACE environment variable (the extension's chart
    # sets it from the pod's own), else "default".
    namespace: str = ""
    # An InferencePool in that namespace: its spec.selector.matchLabels and
    # spec.targetPorts say which pods and ports (watched: a change applies live).
    pool_name: str = ""
    pool_group: str = POOL_GROUP
    # Or the pods themselves: key=value[,key=value] and their ports (1 to 8).
    endpoint_selector: str = ""
    target_ports: tuple[int, ...] = ()
    # A kubeconfig file; "" = in-cluster (the service account) when running in a pod,
    # else $KUBECONFIG or ~/.kube/config.
    kubeconfig: str = ""
    # Active-passive replicas (`gorgo epp --ha-enable-leader-election`): the replicas
    # hold a coordination.k8s.io Lease, and only its holder is ready (serves); off, every
    # replica serves (active-active, sharing dispatches over `bus.nats_url`).
    leader_election: LeaderElection = field(default_factory=lambda: LeaderElection())

    @property
    def enabled(self) -> bool:
        return bool(self.pool_name or self.endpoint_selector)


@dataclass(frozen=True)
class BackendTemplate:
    """What every discovered endpoint is, beside its id (the pod's name, with its port's
    rank when the pool has several) and address (pod IP:port): `backends:` items' other
    keys, with the same meaning."""

    region: str = ""
    # The extension's model servers are vLLM unless told otherwise (its chart's default).
    engine: EngineKind = EngineKind.VLLM
    rtt_prior_ms: float = bounded(1.0, **NON_NEGATIVE)
    engine_profile: str = DEFAULT_PROFILE
    kv_capacity_tokens: int = bounded(0, **NON_NEGATIVE)
    # `*` in an endpoint is the pod's IP: tcp://*:5557.
    kv_events: KvEventsSource = field(default_factory=KvEventsSource)
    models: tuple[str, ...] = ()
    priority_scheduling: PriorityScheduling = PriorityScheduling.AUTO

    def backend(self, backend_id: str, address: str) -> Backend:
        return Backend(
            id=backend_id,
            address=address,
            region=self.region,
            engine=self.engine,
            rtt_prior_ms=self.rtt_prior_ms,
            engine_profile=self.engine_profile,
            kv_capacity_tokens=self.kv_capacity_tokens,
            kv_events=self.kv_events,
            models=self.models,
            priority_scheduling=self.priority_scheduling,
        )


@dataclass(frozen=True)
class Discovery:
    """The `discovery:` section. Off unless `kubernetes.pool_name` or
    `kubernetes.endpoint_selector` is set; then `backends:` may be empty, and the
    discovered backends join (and leave) the fleet as the pods come and go."""

    kubernetes: KubernetesDiscovery = field(default_factory=KubernetesDiscovery)
    backend: BackendTemplate = field(default_factory=BackendTemplate)

    @property
    def enabled(self) -> bool:
        return self.kubernetes.enabled
