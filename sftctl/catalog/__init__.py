"""Accelerator offerings: what each provider sells, where, and for how much.

Cloud offerings come from ``offerings.csv`` (one row per instance type and region, with the source
of its price, the date of the price (``as_of``) and the source of its bandwidths). The local
machine's offering is built from the machine itself: ``cpu`` with one process per node per
requested count, priced at $0/h. Prices are USD per hour per node.

Bandwidths are unidirectional bytes/s: ``intra_node_bytes_per_s`` per accelerator between the
accelerators of one node (NVLink/NVSwitch, Infinity Fabric or PCIe; empty for single-accelerator
nodes), ``inter_node_bytes_per_s`` per node to the other nodes (EFA, GPUDirect NICs, or the
instance's documented "up to" network figure).

Accelerator hardware facts (``accelerators.yaml``: FLOP/s, bandwidths, SM resources, each with
its source) are owned by :mod:`sftctl.catalog.accelerators`; the compiler reads them through
``sftctl.compiler.hardware``, which re-exports that module. How an accelerator is recognized (a
CUDA device, Kubernetes node labels, a GCE accelerator type, a Slurm GPU type, the calibration it
shares) is the ``identity:`` column of the same table, read by :mod:`sftctl.catalog.identity`
(``catalog.identify(device)``). The catalog imports no compiler code.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import os
from pathlib import Path

from sftctl.catalog.accelerators import find_accelerator
from sftctl.catalog.identity import identify  # noqa: F401 - catalog.identify(device)
from sftctl.types import Offering  # the vocabulary; re-exported here

_CSV = Path(__file__).with_name("offerings.csv")
#: the price snapshot built by ``python -m sftctl.catalog.build`` from SkyPilot's public catalog
SNAPSHOT = Path(__file__).with_name("snapshot.csv")
#: offerings.csv's columns; the snapshot adds ``zone`` (the spot price's zone), a refreshed
#: catalog also ``spot_zones`` (``zone=price`` per zone, ``;``-separated, cheapest first)
COLUMNS = ["provider", "instance_type", "accelerator", "count", "vcpus", "memory_gib", "region", "usd_per_hour",
           "spot_usd_per_hour", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "as_of", "source",
           "bandwidth_source", "zone", "spot_zones"]
#: ``catalog`` and ``plan`` warn when the snapshot's prices are older than this many days
STALE_DAYS = 7
#: the override file's columns (``spot_usd_per_hour`` and ``note`` may be empty)
OVERRIDE_COLUMNS = ["provider", "instance_type", "region", "usd_per_hour", "spot_usd_per_hour", "note"]


def cloud_offerings() -> list[Offering]:
    """The cloud offerings: ``offerings.csv``'s hand-sourced rows, replaced or extended by the
    shipped snapshot's rows and then the refreshed catalog's (:func:`price_files`; same provider,
    instance type and region: the later file's prices unless the earlier row's ``as_of`` is
    newer, the hand-sourced bandwidths where the later row has none; for the clouds and regions
    a refresh read (its coverage line) only the refreshed rows), then the user's override
    file's prices (see :func:`override_path`), which win. Read once per process and version of
    the override file and the refreshed catalog.

    Raises:
        SftctlError: a malformed override file (names the file, line and field; exit 2).
    """
    path = override_path()
    stamp = path.stat().st_mtime_ns if path is not None and path.is_file() else None
    refreshed = refreshed_path()
    fresh = refreshed.stat().st_mtime_ns if refreshed.is_file() else None
    return list(_cloud_offerings(str(path) if stamp is not None else "", stamp, str(refreshed), fresh))


@functools.lru_cache(maxsize=4)
def _cloud_offerings(override: str, _stamp: int | None, _refreshed: str, _fresh: int | None) -> tuple[Offering, ...]:
    merged = {(o.provider, o.instance_type, o.region): o for o in _read_offerings(_CSV)}
    files, refreshed = price_files(), refreshed_path()
    # a refresh is the truth for the clouds and regions it read: what it did not find there (a
    # type no longer sold, a region without it) is not offered from the older files either
    covered = refreshed_coverage(refreshed) if refreshed in files else {}
    merged = {k: o for k, o in merged.items() if not _covers(covered, o.provider, o.region) or _unread(o)}
    for path in files:
        for o in _read_offerings(path):
            if path != refreshed and _covers(covered, o.provider, o.region) and not _unread(o):
                continue
            old = merged.get((o.provider, o.instance_type, o.region))
            if old is not None and _newer(old.as_of, o.as_of):
                continue  # a hand-sourced price newer than the snapshot's figures stays
            if old is not None and o.intra_node_bytes_per_s is None and o.inter_node_bytes_per_s is None:
                o = dataclasses.replace(o, intra_node_bytes_per_s=old.intra_node_bytes_per_s,
                                        inter_node_bytes_per_s=old.inter_node_bytes_per_s,
                                        bandwidth_source=old.bandwidth_source)
            merged[(o.provider, o.instance_type, o.region)] = o
    out = list(merged.values())
    if override:
        out = _apply_overrides(out, Path(override))
    return tuple(out)


#: a price at least this many days older than the newest price of its instance type (same
#: provider) is flagged in ``plan`` and ``catalog``: an older snapshot row beside a newer one
OLDER_PRICE_DAYS = 28


def older_prices(offerings: list[Offering] | None = None) -> dict[tuple[str, str, str], Offering]:
    """The offerings whose price is at least :data:`OLDER_PRICE_DAYS` older than the newest price
    of the same provider's instance type in ``offerings`` (default: :func:`cloud_offerings`),
    e.g. p5.48xlarge at $98-128/h from a 2025-05 snapshot beside $55.04/h after the 2025-06 cut.
    Returns ``(provider, instance_type, region)`` -> the newest-priced offering of that type (its
    ``as_of`` and ``usd_per_hour`` say what the flagged row is older than); a date that does not
    parse is never flagged."""
    rows = cloud_offerings() if offerings is None else offerings
    newest: dict[tuple[str, str], tuple[datetime.date, Offering]] = {}
    for o in rows:
        d = _parse_date(o.as_of)
        k = (o.provider, o.instance_type)
        if d is not None and (k not in newest or d > newest[k][0]
                              or (d == newest[k][0] and o.usd_per_hour < newest[k][1].usd_per_hour)):
            newest[k] = (d, o)
    out = {}
    for o in rows:
        d = _parse_date(o.as_of)
        top = newest.get((o.provider, o.instance_type))
        if d is not None and top is not None and (top[0] - d).days >= OLDER_PRICE_DAYS:
            out[(o.provider, o.instance_type, o.region)] = top[1]
    return out


def _newer(a: str, b: str) -> bool:
    """Whether price date ``a`` is strictly newer than ``b`` (``YYYY[-MM[-DD]]``; unparsable: no)."""
    da, db = _parse_date(a), _parse_date(b)
    return da is not None and db is not None and da > db


def price_files() -> list[Path]:
    """The price files over ``offerings.csv``, oldest first: the shipped snapshot, then the
    refreshed catalog in the user's data dir (``sftctl catalog refresh``) where there is one."""
    out = [SNAPSHOT] if SNAPSHOT.is_file() else []
    refreshed = refreshed_path()
    if refreshed.is_file():
        out.append(refreshed)
    return out


def _unread(o: Offering) -> bool:
    """Whether ``catalog refresh`` never reads ``o``'s kind: Cloud TPU slices (vendor ``google``)
    are not in the Compute Engine machine and GPU price lists it reads, so a GCP refresh of a
    region keeps their hand-sourced rows."""
    acc = find_accelerator(o.accelerator)
    return acc is not None and acc.vendor == "google"


def _covers(covered: dict[str, list[str] | None], provider: str, region: str) -> bool:
    return provider in covered and (covered[provider] is None or region in covered[provider])


def refreshed_coverage(path: Path | None = None) -> dict[str, list[str] | None]:
    """``{cloud: regions the refreshed catalog read, or None for all}`` (its ``# coverage:`` line)."""
    import json

    path = path or refreshed_path()
    if not path.is_file():
        return {}
    with path.open() as f:
        first = f.readline()
    return json.loads(first[len(_COVERAGE):]) if first.startswith(_COVERAGE) else {}


_COVERAGE = "# coverage: "


def refreshed_path() -> Path:
    """Where ``sftctl catalog refresh`` keeps the catalog it built: ``catalog.csv`` in
    ``$SFTCTL_HOME`` (the user's data dir by default)."""
    from sftctl import paths

    return paths.sftctl_home() / "catalog.csv"


def write_refreshed(rows: list[dict[str, str]], read: dict[str, list[str] | None]) -> Path:
    """Replace the refreshed catalog's rows of the clouds and regions a refresh ``read``
    (``{cloud: regions, or None for all}``) with ``rows`` (:data:`COLUMNS` dicts); its other rows
    stay, and its coverage line adds what was read. The new file is written beside
    the old one, read back as offerings and only then renamed over it (atomic on POSIX), under a
    lock (concurrent refreshes take turns): a failure at any point leaves the previous catalog
    whole. Returns the catalog's path.

    Raises:
        ValueError: a row that does not read back as an offering (nothing is replaced).
    """
    import json
    import os

    from filelock import FileLock

    path = refreshed_path()
    with FileLock(str(path) + ".lock"):
        kept, coverage = [], refreshed_coverage(path)
        if path.is_file():
            with path.open(newline="") as f:
                kept = [r for r in csv.DictReader(_rows(f)) if not _covers(read, r["provider"], r["region"])]
        for cloud, regions in read.items():
            before = coverage.get(cloud, [])
            coverage[cloud] = None if regions is None or (cloud in coverage and before is None) else \
                sorted(set(before or []) | set(regions))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("w", newline="") as f:
                f.write(_COVERAGE + json.dumps(coverage, sort_keys=True) + "\n")
                w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
                w.writeheader()
                w.writerows(sorted(kept + list(rows), key=lambda r: (r["provider"], r["instance_type"], r["region"])))
                f.flush()
                os.fsync(f.fileno())
            _read_offerings(tmp)  # every row must read back
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def _read_offerings(path: Path) -> list[Offering]:
    """The offerings of one catalog CSV (``offerings.csv`` or the snapshot)."""
    with path.open(newline="") as f:
        return [
            Offering(
                provider=r["provider"],
                instance_type=r["instance_type"],
                accelerator=r["accelerator"],
                count=int(r["count"]),
                region=r["region"],
                usd_per_hour=float(r["usd_per_hour"]),
                spot_usd_per_hour=float(r["spot_usd_per_hour"]) if r["spot_usd_per_hour"] else None,
                vcpus=int(r["vcpus"]),
                memory_gib=float(r["memory_gib"]),
                source=r["source"],
                intra_node_bytes_per_s=_opt_float(r.get("intra_node_bytes_per_s")),
                inter_node_bytes_per_s=_opt_float(r.get("inter_node_bytes_per_s")),
                as_of=(r.get("as_of") or "").strip(),
                bandwidth_source=(r.get("bandwidth_source") or "").strip(),
                zone=(r.get("zone") or "").strip(),
                spot_zones=_zone_prices(r.get("spot_zones") or ""),
            )
            for r in csv.DictReader(_rows(f))
        ]


def _rows(f):
    """A catalog file's lines without its ``#`` comment lines (the refreshed catalog's coverage)."""
    return (line for line in f if not line.startswith("#"))


def override_path() -> Path | None:
    """The price override file (``SFTCTL_CATALOG_OVERRIDES``, default ``prices.csv`` in the user's
    config dir), whether or not it exists; None when the setting is empty."""
    import platformdirs

    from sftctl import settings

    value = settings.get("SFTCTL_CATALOG_OVERRIDES")
    if value:
        return Path(value).expanduser()
    return Path(platformdirs.user_config_dir("sftctl", appauthor=False)) / "prices.csv"


def _apply_overrides(offerings: list[Offering], path: Path) -> list[Offering]:
    """``offerings`` with the override file's prices: a row matches provider, instance type and
    region (``*``: every region); its source says ``override <path>:<line>`` and its as_of is the
    file's modification date. A row that matches nothing is an error (a typo would silently
    leave the list price in force).

    Raises:
        SftctlError: a missing column, a price that is not a number >= 0, a row matching no
            offering (each names the file, line and field; exit 2).
    """
    from sftctl.errors import SftctlError

    as_of = datetime.date.fromtimestamp(path.stat().st_mtime).isoformat()
    hint = f"columns: {','.join(OVERRIDE_COLUMNS)} (USD per hour per node; region * for every region)"
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in OVERRIDE_COLUMNS[:4] if c not in (reader.fieldnames or [])]
        if missing:
            raise SftctlError(f"{path}:1: price override file lacks column {missing[0]}", hint)
        out = list(offerings)
        for line, r in enumerate(reader, start=2):
            prices: dict = {}
            for field in ("usd_per_hour", "spot_usd_per_hour"):
                text = (r.get(field) or "").strip()
                if not text:
                    continue
                try:
                    prices[field] = float(text)
                except ValueError:
                    prices[field] = -1.0
                if prices[field] < 0:
                    raise SftctlError(f"{path}:{line}: {field} {text!r} is not a price", hint)
            if "usd_per_hour" not in prices:
                raise SftctlError(f"{path}:{line}: usd_per_hour is empty", hint)
            note = (r.get("note") or "").strip()
            source = f"override {path}:{line}" + (f" ({note})" if note else "")
            hits = 0
            for i, o in enumerate(out):
                if (o.provider, o.instance_type) == (r["provider"].strip(), r["instance_type"].strip()) \
                        and r["region"].strip() in ("*", o.region):
                    out[i] = dataclasses.replace(o, source=source, as_of=as_of, **prices)
                    hits += 1
            if not hits:
                raise SftctlError(f"{path}:{line}: no offering {r['provider']} {r['instance_type']} in region "
                                  f"{r['region']}", "see sftctl catalog for the instance types and regions")
    return out


def catalog_age(today: datetime.date | None = None) -> dict:
    """How old the catalog's prices are: ``{"as_of": the newest price file's newest price date
    (ISO), "age_days": int, "stale": age_days > STALE_DAYS, "stale_after_days": STALE_DAYS, "file": that file (the refreshed
    catalog, else the shipped snapshot), "overrides": the override file in force or None}``.
    Without either, ``as_of`` is offerings.csv's newest date (a year-month reads as its first
    day)."""
    today = today or datetime.date.today()
    files = price_files()
    path = files[-1] if files else _CSV
    dates = [_parse_date(o.as_of) for o in _read_offerings(path)]
    newest = max((d for d in dates if d is not None), default=None)
    age = (today - newest).days if newest else None
    override = override_path()
    return {"as_of": newest.isoformat() if newest else None, "age_days": age,
            "stale": age is None or age > STALE_DAYS, "stale_after_days": STALE_DAYS, "file": str(path),
            "overrides": str(override) if override is not None and override.is_file() else None}


def _parse_date(text: str) -> datetime.date | None:
    parts = text.strip().split("-")
    try:
        return datetime.date(int(parts[0]), int(parts[1]) if len(parts) > 1 else 1,
                             int(parts[2]) if len(parts) > 2 else 1)
    except (ValueError, IndexError):
        return None


def _zone_prices(text: str) -> tuple[tuple[str, float], ...]:
    """``zone=price;zone=price`` as pairs (the catalog CSV's ``spot_zones`` column)."""
    pairs = (item.partition("=") for item in text.split(";") if item.strip())
    return tuple((z.strip(), float(p)) for z, _, p in pairs)


def zone_prices_text(pairs) -> str:
    """The ``spot_zones`` column of ``(zone, price)`` pairs."""
    return ";".join(f"{z}={p!r}" for z, p in pairs)


def _opt_float(text: str | None) -> float | None:
    text = (text or "").strip()
    return float(text) if text else None


# Worker processes on one machine exchange tensors through shared memory (torch.distributed gloo over
# loopback / shm). ASSUMPTION: ~10 GB/s each way, a memcpy-class figure well below DRAM bandwidth.
LOCAL_INTRA_NODE_BYTES_PER_S = 10e9


def local_offering(count: int) -> Offering:
    """This machine as one offering: ``count`` CPU worker processes per node, free.

    Intra-node bandwidth is an assumption (shared memory, ``LOCAL_INTRA_NODE_BYTES_PER_S``); there is
    no inter-node network. ``as_of`` is today: the price ($0) is always current.
    """
    return Offering(
        provider="local",
        instance_type="localhost",
        accelerator="cpu",
        count=count,
        region="local",
        usd_per_hour=0.0,
        spot_usd_per_hour=0.0,
        vcpus=os.cpu_count(),
        source="this machine",
        intra_node_bytes_per_s=LOCAL_INTRA_NODE_BYTES_PER_S,
        inter_node_bytes_per_s=None,
        as_of=datetime.date.today().isoformat(),
        bandwidth_source="assumption: worker processes share memory, ~10 GB/s each way",
    )


def accelerator_names() -> list[str]:
    """Every accelerator name sftctl knows: those offered, and those in the hardware table
    (``sftctl/catalog/accelerators.yaml``, which the compiler can target even unoffered)."""
    from sftctl.catalog.accelerators import load_accelerators

    return sorted({o.accelerator for o in cloud_offerings()} | set(load_accelerators()) | {"cpu"})
