"""The serving system around one cache: what a production server adds to the study guide's
KV-cache module, each part built on the serving layer and none needed by it.

Below the device pool, a host-memory tier (`TieredCacheManager`: evicted prefixes move to a
`HostKVPool` and load back on a match, under four write policies; `HostLink` names the copy
bandwidth) and a third tier on local disk (`DiskKVStore`: pages in files named by the content
hash of their prefix); the tier's events carry their medium (`TierEvent`), which a
`TieredPrefixMirror` follows. Beside one server,
the `Router` that spreads requests over replicas, cache-aware through a `PrefixMirror` of each
replica fed by its cache events. Above it, tenants sharing one cache (`PublicPrefixCache`, the
`multi_tenant` workload and `replay_tenants`).
"""

from .disk_store import DiskKVStore, DiskStats
from .host_pool import NVLINK_C2C, PCIE4_X16, PCIE5_X16, HostKVPool, HostLink
from .host_tier import TIER_POLICIES, TieredCacheManager, TierStats
from .prefix_mirror import MEDIA, PrefixMirror, TieredPrefixMirror, TierEvent
from .router import ROUTING_POLICIES, Router, RouterReport, poisson_arrivals
from .tenancy import PublicPrefixCache, TenantJob, multi_tenant, replay_tenants

__all__ = [
    "TieredCacheManager",
    "TierStats",
    "TIER_POLICIES",
    "DiskKVStore",
    "DiskStats",
    "TierEvent",
    "TieredPrefixMirror",
    "MEDIA",
    "HostKVPool",
    "HostLink",
    "PCIE4_X16",
    "PCIE5_X16",
    "NVLINK_C2C",
    "Router",
    "RouterReport",
    "ROUTING_POLICIES",
    "PrefixMirror",
    "poisson_arrivals",
    "PublicPrefixCache",
    "TenantJob",
    "multi_tenant",
    "replay_tenants",
]
