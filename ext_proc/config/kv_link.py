"""The links the prompt's KV crosses in a disaggregated fleet (`routing.kv_link`): a
default bandwidth and RTT, and a table per pair of regions; and the fleet's check that
every prefill engine has a decode engine for its models, and the other way round."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ext_proc.vocab.backend import Backend, BackendRole
from ext_proc.vocab.params import NON_NEGATIVE, POSITIVE, ConfigError, bounded


@dataclass(frozen=True)
class KvLinkEntry:
    """`routing.kv_link.links[]`: the link between two regions (both ways; the same region
    twice: the link within it)."""

    regions: tuple[str, ...] = ()
    gbps: float = bounded(10.0, **POSITIVE)
    # The link's round trip, paid once per transfer (ms).
    rtt_ms: float = bounded(0.0, **NON_NEGATIVE)


@dataclass(frozen=True)
class KvLinks:
    """`routing.kv_link`: the bandwidth and RTT of a link between two engines' regions
    (docs/cost-model.md, "The pair's price"): the table's entry for the pair of regions,
    else the defaults."""

    gbps: float = bounded(10.0, **POSITIVE)
    rtt_ms: float = bounded(0.0, **NON_NEGATIVE)
    links: tuple[KvLinkEntry, ...] = ()

    def link(self, a: str, b: str) -> tuple[float, float]:
        """(gbps, rtt_ms) of the link between regions a and b."""
        for entry in self.links:
            if sorted(entry.regions) == sorted((a, b)):
                return entry.gbps, entry.rtt_ms
        return self.gbps, self.rtt_ms


def validate_kv_links(links: KvLinks, key: str = "routing.kv_link") -> None:
    """Each entry names two regions (or one region twice), each pair once."""
    seen: set[tuple[str, ...]] = set()
    for i, entry in enumerate(links.links):
        if len(entry.regions) != 2 or not all(entry.regions):
            raise ConfigError(
                f"{key}.links[{i}].regions: two region names (a region twice: the link "
                f"within it), got {list(entry.regions)!r}"
            )
        pair = tuple(sorted(entry.regions))
        if pair in seen:
            raise ConfigError(f"{key}.links[{i}].regions: {list(pair)!r} listed twice")
        seen.add(pair)


def _shares_a_model(a: Backend, b: Backend) -> bool:
    """Whether a and b may serve one model (an empty list: whatever its engine lists)."""
    return not a.models or not b.models or bool(set(a.models) & set(b.models))


def validate_roles(backends: Sequence[Backend]) -> None:
    """A prefill engine needs a decode engine serving one of its models (or an aggregated
    one, which the Envoy path sends a decode leg to: docs/envoy.md), and a decode engine a
    prefill engine: a half of a pair alone serves nothing."""
    partners = {
        BackendRole.PREFILL: (BackendRole.DECODE, BackendRole.BOTH),
        BackendRole.DECODE: (BackendRole.PREFILL,),
    }
    for role, others in partners.items():
        other = others[0]
        for i, b in enumerate(backends):
            if b.role is not role:
                continue
            if not any(o.role in others and _shares_a_model(b, o) for o in backends):
                models = f" for {list(b.models)!r}" if b.models else ""
                raise ConfigError(
                    f"backends[{i}].role: {role.value} engine {b.id!r} has no {other.value} "
                    f"engine{models} to pair with"
                )
