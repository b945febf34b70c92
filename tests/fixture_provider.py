"""A provider that lives outside sftctl (issue 39.3): registered only by ``SFTCTL_PROVIDERS=
fixture=fixture_provider`` with this directory on ``sys.path``, as a site would install a
provider package. Nothing in ``sftctl/`` names it: the registry imports this module for its
``PROVIDER`` declaration, the spec's ``resources.clouds`` takes its name, the planner asks it for
offerings (it declares :class:`~sftctl.providers.base.LiveOfferings`), the controller provisions,
launches, watches and tears down its nodes, and state keeps its typed handle.

Its nodes are processes on this machine, like the local provider's (it reuses that class's
process handling): a fixture of the registry, not a new way to run a node. Its one offering is
``cpu:N`` at a price of its own, so a test can tell its row from the local one.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from sftctl.providers.base import ProviderEntry
from sftctl.providers.local import LocalProvider
from sftctl.types import LocalHandle, Offering

#: USD per hour of the fixture's offering: not the local provider's (0.0)
PRICE_USD_PER_HOUR = 0.25


@dataclasses.dataclass(frozen=True)
class FixtureHandle(LocalHandle):
    """A fixture node: a local node's fields under the provider name ``fixture`` (registered with
    :class:`sftctl.types.NodeHandle` as the class is defined)."""

    provider: ClassVar[str] = "fixture"


class FixtureProvider(LocalProvider):
    """Nodes as processes on this machine, offered as ``fixture``."""

    name = "fixture"

    @classmethod
    def for_plan(cls, spec=None) -> "FixtureProvider":
        """The instance the planner asks for offerings (:class:`~sftctl.providers.base.LiveOfferings`)."""
        return cls()

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """The local provider's ``cpu:count``, as the fixture's, at :data:`PRICE_USD_PER_HOUR`."""
        return [dataclasses.replace(o, provider=self.name, instance_type=f"fixture-cpu-{count}",
                                    usd_per_hour=PRICE_USD_PER_HOUR, source="tests/fixture_provider.py")
                for o in super().offerings(accelerator, count)]

    def provision(self, job_id: str, node_id: str, rank: int, offering: Offering, **kw: object) -> FixtureHandle:
        handle = super().provision(job_id, node_id, rank, offering, **kw)
        return FixtureHandle(**{f.name: getattr(handle, f.name) for f in dataclasses.fields(handle)})


PROVIDER = ProviderEntry("fixture", "FixtureProvider")
