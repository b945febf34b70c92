"""Spot as a policy: what a preemption does to a job (``resources.spot``, :class:`SpotGuard`).

A spot node (its handle says ``spot``) that vanished without an exit code (its instance gone or
stopping) was taken back by the cloud. The controller then, through :meth:`SpotGuard.preempted`:

* blocks that zone for the instance type for ``resources.spot.zone_cooldown`` in state.db
  (:meth:`sftctl.state.Store.block_zone`), so every job's next provisioning skips it
  (:meth:`SpotGuard.seed` fills the provider's ``blocked_zones``, which
  :meth:`sftctl.providers.cloud.CloudProvider.provision` skips): the replacement lands in another
  zone of the region;
* records a ``spot`` event naming the zone, the block and the preemption's count (a restarted
  controller counts on from the job's events);
* after ``resources.spot.fallback_on_demand_after`` preemptions, provisions on demand from then
  on (a second ``spot`` event says so).

The replacement itself is the controller's usual REPLACE (a restart counted against
``recovery.max_restarts``), with the failure recorded as :attr:`FailureCode.PREEMPTED`.
"""

from __future__ import annotations

import time

from sftctl.providers.base import BlocksZones
from sftctl.types import FailureCode, FailureReason


class SpotGuard:
    """One job's spot policy at run time (see the module docstring)."""

    def __init__(self, store, job_id: str, spec):
        self.store, self.job_id = store, job_id
        self.rules = spec.resources.spot_rules
        self.enabled = bool(spec.resources.spot)
        self.count = sum(1 for e in store.events(job_id) if e.kind == "spot" and (e.data or {}).get("preempted"))
        limit = self.rules.fallback_on_demand_after
        self.on_demand = self.enabled and limit is not None and self.count >= limit

    @property
    def spot(self) -> bool:
        """Whether new nodes are asked for on spot (False once the job fell back to on demand)."""
        return self.enabled and not self.on_demand

    @staticmethod
    def is_preemption(handle) -> bool:
        """Whether a vanished node was a spot node (the cloud took it back)."""
        return bool(getattr(handle, "spot", False))

    def seed(self, provider) -> None:
        """Add the zones still in their cool-down (every job's, from state.db) to ``provider``'s
        ``blocked_zones`` (providers without zones have none: nothing to do)."""
        name = provider.name
        if isinstance(provider, BlocksZones):
            provider.blocked_zones |= set(self.store.blocked_zones(name))

    def preempted(self, provider, offering, node_rank: int, handle, detail: str) -> FailureReason:
        """Record node ``node_rank``'s preemption: block its zone, count it, fall back to on
        demand at the limit. Returns the :attr:`FailureCode.PREEMPTED` reason of the attempt."""
        zone = getattr(handle, "zone", None) or ""
        self.count += 1
        until = time.time() + self.rules.zone_cooldown_s
        if zone:
            self.store.block_zone(provider.name, offering.instance_type, zone, until,
                                  f"a spot {offering.instance_type} of job {self.job_id} was taken back", self.job_id)
        where = zone or offering.region
        message = (f"node {node_rank}: spot capacity taken back in {where} ({detail}); preemption {self.count}"
                   + (f"; zone {zone} avoided for {self.rules.zone_cooldown}" if zone else ""))
        data = {"preempted": True, "node_rank": node_rank, "zone": zone, "region": offering.region,
                "instance_type": offering.instance_type, "count": self.count, "blocked_until": until if zone else None}
        self.store.add_event(self.job_id, "spot", message, data)
        limit = self.rules.fallback_on_demand_after
        if limit is not None and self.count >= limit and not self.on_demand:
            self.on_demand = True
            self.store.add_event(self.job_id, "spot", (
                f"{self.count} preemption(s) (resources.spot.fallback_on_demand_after {limit}): nodes are "
                "provisioned on demand from now on"), {"fallback_on_demand": True, "count": self.count})
        self.seed(provider)
        return FailureReason(FailureCode.PREEMPTED, message, data)
