"""Choose where a job runs: the cheapest feasible offering whose provider is usable here.

Until the search compiler predicts step times, offerings are ranked by price per hour for all
nodes (spot price when ``resources.spot``), cheapest first; ties go to the order the spec lists
its accelerators in. The plan says which offering it chose and why, and why the others lost.
"""

from __future__ import annotations

import dataclasses
import difflib

from sftctl.catalog import Offering, accelerator_names, cloud_offerings
from sftctl.errors import InfeasibleError, SpecError
from sftctl.spec import JobSpec


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One offering considered for the job, with its price for all nodes and why it lost."""

    offering: Offering
    usd_per_hour: float | None  # all nodes together; None when the offering has no spot price
    rejected: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The chosen offering, the reason in one line, and every candidate that was considered."""

    offering: Offering
    nodes: int
    usd_per_hour: float
    reason: str
    candidates: list[Candidate]

    def to_dict(self) -> dict:
        return {
            "offering": self.offering.to_dict(),
            "nodes": self.nodes,
            "usd_per_hour": self.usd_per_hour,
            "reason": self.reason,
            "candidates": [
                {
                    "provider": c.offering.provider,
                    "instance_type": c.offering.instance_type,
                    "accelerator": f"{c.offering.accelerator}:{c.offering.count}",
                    "region": c.offering.region,
                    "usd_per_hour": c.usd_per_hour,
                    "rejected": c.rejected,
                }
                for c in self.candidates
            ],
        }


def plan(spec: JobSpec, usable: dict[str, str | None] | None = None) -> Plan:
    """Rank the offerings that match ``spec.resources`` and pick the cheapest usable one.

    Args:
        spec: the validated job spec.
        usable: provider name -> None if usable here, else why not. Default: ask the providers.

    Raises:
        SpecError: an accelerator name the catalog does not know (exit 2), with a did-you-mean.
        InfeasibleError: nothing matches, or nothing that matches is usable (exit 3).
    """
    if usable is None:
        from sftctl.providers import usable_providers

        usable = usable_providers()
    res = spec.resources
    known = {n.lower(): n for n in accelerator_names()}
    candidates: list[Candidate] = []
    for i, acc in enumerate(res.accelerators):
        if acc.name.lower() not in known:
            close = difflib.get_close_matches(acc.name, list(known.values()), n=1, cutoff=0.5)
            raise SpecError(
                f"resources.accelerators[{i}]: unknown accelerator {acc.name!r}"
                + (f"; did you mean '{close[0]}'?" if close else ""),
                hint=f"known accelerators: {', '.join(known.values())}",
            )
        for offering in _offerings(acc.name, acc.count):
            candidates.append(_judge(offering, spec, usable))
    feasible = [c for c in candidates if c.rejected is None]
    if not feasible:
        wanted = ", ".join(str(a) for a in res.accelerators)
        reasons = sorted({f"{c.offering.provider}: {c.rejected}" for c in candidates})
        raise InfeasibleError(
            f"no offering can run {res.nodes} node(s) of {wanted}"
            + (f" ({'; '.join(reasons)})" if reasons else ": no provider offers it"),
            hint="widen resources (accelerators, clouds, regions, max_price_per_hour, spot)",
        )
    best = min(feasible, key=lambda c: c.usd_per_hour)  # min() keeps the first of equal prices
    o = best.offering
    others = len(candidates) - 1
    blocked = sorted({c.offering.provider for c in candidates if c.rejected})
    reason = (
        f"chose {o.provider} {o.instance_type} ({o.accelerator}:{o.count}) x {res.nodes} node(s) "
        f"at ${best.usd_per_hour:.2f}/h: cheapest of {len(feasible)} feasible offering(s)"
        + (f"; {others} other(s) considered" if others else "")
        + (f", not usable here: {', '.join(blocked)}" if blocked else "")
    )
    return Plan(o, res.nodes, best.usd_per_hour, reason, candidates)


def _offerings(accelerator: str, count: int) -> list[Offering]:
    if accelerator.lower() == "cpu":
        from sftctl.providers.local import LocalProvider

        return LocalProvider().offerings(accelerator, count)
    return [
        o
        for o in cloud_offerings()
        if o.accelerator.lower() == accelerator.lower() and o.count == count
    ]


def _judge(o: Offering, spec: JobSpec, usable: dict[str, str | None]) -> Candidate:
    res = spec.resources
    unit = o.price(res.spot)
    price = None if unit is None else unit * res.nodes
    if res.clouds is not None and o.provider not in res.clouds:
        return Candidate(o, price, f"not in resources.clouds {res.clouds}")
    if res.regions is not None and o.region not in res.regions and o.provider != "local":
        return Candidate(o, price, f"region {o.region} not in resources.regions")
    if price is None:
        return Candidate(o, price, "no spot price for this offering")
    if res.max_price_per_hour is not None and price > res.max_price_per_hour:
        return Candidate(o, price, f"${price:.2f}/h is above max_price_per_hour ${res.max_price_per_hour:.2f}")
    why_not = usable.get(o.provider, "unknown provider")
    if why_not:
        return Candidate(o, price, why_not)
    return Candidate(o, price)
