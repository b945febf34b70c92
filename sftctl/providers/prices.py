"""Price lists read from the clouds' own APIs with the user's credentials (``sftctl catalog refresh``).

Each function returns catalog rows (:data:`sftctl.catalog.COLUMNS`: one per instance type and
region, ``spot_zones`` with every zone's spot price, ``as_of`` today, ``source`` naming the APIs
and the time they were read) for :func:`sftctl.catalog.write_refreshed`, which keeps the previous
catalog whole unless every call succeeded. Calls run in parallel (a thread pool of ``workers``)
and are retried while the cloud throttles them (tenacity, through each provider's ``_call``:
:func:`sftctl.providers.cloud.retry_throttled`); any other failure raises, nothing is returned
half-done.

AWS (:func:`aws_rows`), per region: ``DescribeInstanceTypes`` (``p*``/``g*`` types with GPUs:
accelerator from ``GpuInfo`` name and memory, vCPUs, memory, network performance),
``DescribeInstanceTypeOfferings`` per availability zone, ``DescribeSpotPriceHistory`` (the
newest Linux/UNIX price per zone) and, from the Price List Query API (``pricing`` in us-east-1),
``GetProducts`` per region (Linux, shared tenancy, no pre-installed software, capacity status
Used: the on-demand USD per hour of each instance type). A type without an on-demand price (sold as
capacity blocks only) is left out.

GCP (:func:`gcp_rows`): the project's zones (``UP`` ones of the regions asked), per zone
``acceleratorTypes.list`` and ``machineTypes.list`` (the A2/A3/A4/G2 types that carry GPUs; N1
hosts for T4/V100 as :data:`sftctl.catalog.build.GCP_N1_HOSTS`), and the Cloud Billing Catalog's
Compute Engine SKUs (service ``6F81-5844-456A``): a machine's price is vCPUs x its family's core
SKU + GiB x its RAM SKU + GPUs x the GPU SKU of its region (``OnDemand``; ``Preemptible`` for
spot, which GCP prices per region: every zone of the region gets it). The Billing endpoint is
Google's, or ``SFTCTL_GCE_ENDPOINT`` where that is set (the emulator serves both).

Bandwidths: ``sftctl.catalog.build.bandwidth_table`` (hand-sourced and published figures) by
instance type; else the inter-node figure from ``NetworkInfo.NetworkPerformance`` (AWS) and, for
multi-GPU nodes, an assumed PCIe 4.0 x16 link (stated in ``bandwidth_source``).
"""

from __future__ import annotations

import datetime
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

#: The Cloud Billing Catalog service of Compute Engine.
GCE_BILLING_SERVICE = "services/6F81-5844-456A"
#: GPU SKU descriptions' model words -> GCE accelerator type ("Nvidia Tesla T4 GPU running in ...").
GCE_GPU_SKUS = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100", "A100": "nvidia-tesla-a100",
                "A100 80GB": "nvidia-a100-80gb", "H100 80GB": "nvidia-h100-80gb",
                "H100 80GB Mega": "nvidia-h100-mega-80gb", "H200 141GB": "nvidia-h200-141gb", "L4": "nvidia-l4",
                "B200": "nvidia-b200"}
_PCIE_ASSUMED = ("2.5e10", "GPUs assumed on PCIe 4.0 x16 (~25 GB/s; the API does not say how they are linked)")
_GPU_SKU = re.compile(r"Nvidia (?:Tesla )?(?P<model>[A-Z]\d+(?: \d+GB)?(?: Mega)?) GPU")
_CORE_RAM_SKU = re.compile(r"^(?:Spot Preemptible )?(?P<family>[A-Z]\d[\w ]*?) (?:Predefined )?Instance "
                           r"(?P<kind>Core|Ram)\b")


def _source(what: str, read_at: str) -> str:
    return f"{what}, read {read_at} with the user's credentials (sftctl catalog refresh)"


def _now() -> tuple[str, str]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.date().isoformat(), now.strftime("%Y-%m-%dT%H:%MZ")


def _row(provider: str, itype: str, accelerator: str, count: int, vcpus: float, memory_gib: float, region: str,
         price: float, zones: dict[str, float], bandwidth: tuple[str, str, str], as_of: str, source: str) -> dict:
    from sftctl.catalog import zone_prices_text

    spot = sorted(((z, round(p, 6)) for z, p in zones.items() if 0 < p < price), key=lambda zp: (zp[1], zp[0]))
    return {"provider": provider, "instance_type": itype, "accelerator": accelerator, "count": str(count),
            "vcpus": str(int(vcpus)), "memory_gib": f"{memory_gib:g}", "region": region,
            "usd_per_hour": repr(round(price, 6)), "spot_usd_per_hour": repr(spot[0][1]) if spot else "",
            "intra_node_bytes_per_s": bandwidth[0] if count > 1 else "", "inter_node_bytes_per_s": bandwidth[1],
            "as_of": as_of, "source": source, "bandwidth_source": bandwidth[2], "zone": spot[0][0] if spot else "",
            "spot_zones": zone_prices_text(spot)}


def _bandwidth(itype: str, count: int, network_gbps: float | None, network_text: str) -> tuple[str, str, str] | None:
    """(intra, inter, source) of ``itype``: the bandwidth table's, else the API's network figure."""
    from sftctl.catalog.build import bandwidth_table

    known = bandwidth_table().get(itype)
    if known is not None:
        return known["intra_node_bytes_per_s"], known["inter_node_bytes_per_s"], known["bandwidth_source"]
    if network_gbps is None:
        return None
    inter = repr(network_gbps * 1e9 / 8)
    if count == 1:
        return "", inter, f"One GPU per node; {network_text} network (the cloud's API)"
    return _PCIE_ASSUMED[0], inter, f"{count} {_PCIE_ASSUMED[1]}; {network_text} network (the cloud's API)"


def _gbps(text: str) -> float | None:
    """``"Up to 25 Gigabit"`` / ``"3200 Gigabit"`` / ``"4x 100 Gigabit"`` -> Gbps."""
    m = re.search(r"(?:(\d+)x\s*)?(\d+(?:\.\d+)?)\s*Gigabit", text or "")
    return (int(m.group(1) or 1) * float(m.group(2))) if m else None


def _pool(workers: int, fn: Callable, items: Iterable) -> list:
    """``[fn(item) for item in items]`` on ``workers`` threads; the first exception is raised."""
    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(items)))) as pool:
        return list(pool.map(fn, items))


# ------------------------------------------------------------------------------------ AWS


def aws_rows(regions: list[str] | None = None, *, workers: int = 16, provider=None,
             progress: Callable[[str], None] | None = None) -> tuple[list[dict], list[str]]:
    """``(catalog rows, the regions read)``: every GPU instance type AWS sells on demand in
    ``regions`` (None: every region ``DescribeRegions`` lists; names AWS does not know are
    skipped). See the module docstring.

    Raises:
        CredentialsError: no usable AWS credentials (exit 4).
        ProviderError: a call failed after the throttling retries (names the call and region).
    """
    from sftctl.catalog.identity import identify
    from sftctl.providers.aws import AWSProvider

    p = provider or AWSProvider()
    as_of, read_at = _now()
    source = _source("AWS APIs: EC2 DescribeInstanceTypes, DescribeInstanceTypeOfferings, DescribeSpotPriceHistory; "
                     "Price List GetProducts (on-demand)", read_at)
    home = "us-east-1"
    try:
        known = sorted(r["RegionName"] for r in p._call("ec2", home, "describe_regions")["Regions"])
    except Exception as e:  # noqa: BLE001 the SDK's error, translated (p._fail)
        raise p._fail(e, "list the regions (DescribeRegions)") from None
    regions = known if regions is None else [r for r in regions if r in known]  # another cloud's: not here

    def types_of(region: str) -> dict:
        out = {}
        for page in p._pages("ec2", region, "describe_instance_types",
                             Filters=[{"Name": "instance-type", "Values": ["p*", "g*"]}]):
            for t in page["InstanceTypes"]:
                gpus = (t.get("GpuInfo") or {}).get("Gpus") or []
                if not gpus:
                    continue
                g = gpus[0]
                acc = identify(name=g.get("Name", ""), memory_bytes=int((g.get("MemoryInfo") or {}).get("SizeInMiB", 0)) * 2**20)
                if acc is None:
                    continue
                net = (t.get("NetworkInfo") or {}).get("NetworkPerformance", "")
                out[t["InstanceType"]] = {"accelerator": acc.name, "count": int(g.get("Count", 1)),
                                          "vcpus": t["VCpuInfo"]["DefaultVCpus"],
                                          "memory_gib": t["MemoryInfo"]["SizeInMiB"] / 1024, "network": net}
        return out

    def region_rows(region: str) -> list[dict]:
        try:
            types = types_of(region)
            if not types:
                return []
            names = sorted(types)
            zones: dict[str, set[str]] = {n: set() for n in names}
            for page in p._pages("ec2", region, "describe_instance_type_offerings", LocationType="availability-zone",
                                 Filters=[{"Name": "instance-type", "Values": names}]):
                for o in page["InstanceTypeOfferings"]:
                    zones.setdefault(o["InstanceType"], set()).add(o["Location"])
            spot: dict[str, dict[str, tuple]] = {n: {} for n in names}
            start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=6)
            for page in p._pages("ec2", region, "describe_spot_price_history", InstanceTypes=names,
                                 ProductDescriptions=["Linux/UNIX"], StartTime=start):
                for h in page["SpotPriceHistory"]:
                    if not h.get("ProductDescription", "").startswith("Linux/UNIX"):
                        continue
                    key, when = h["AvailabilityZone"], str(h.get("Timestamp", ""))
                    seen = spot.setdefault(h["InstanceType"], {}).get(key)
                    if seen is None or when > seen[1]:  # the newest price per zone
                        spot[h["InstanceType"]][key] = (float(h["SpotPrice"]), when)
        except Exception as e:  # noqa: BLE001 the SDK's error, translated (p._fail)
            raise p._fail(e, f"read the GPU instance types of {region}") from None
        prices = _on_demand(p, region, set(names))
        rows = []
        for n in names:
            t, price = types[n], prices.get(n)
            bw = _bandwidth(n, t["count"], _gbps(t["network"]), t["network"])
            if price is None or not zones.get(n) or bw is None:
                continue
            offered = {z: v[0] for z, v in spot.get(n, {}).items() if z in zones[n]}
            rows.append(_row("aws", n, t["accelerator"], t["count"], t["vcpus"], t["memory_gib"], region, price,
                             offered, bw, as_of, source))
        if progress:
            progress(f"aws {region}: {len(rows)} GPU instance types")
        return rows

    return [r for rows in _pool(workers, region_rows, regions) for r in rows], regions


def _on_demand(p, region: str, instance_types: set[str]) -> dict[str, float]:
    """``{instance type: on-demand USD/h}`` of ``instance_types`` in ``region`` (Linux, shared
    tenancy, no pre-installed software, capacity status Used): one paginated GetProducts walk."""
    import json

    filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in (
        ("regionCode", region), ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
        ("capacitystatus", "Used"))]
    try:
        pages = p._pages("pricing", "us-east-1", "get_products", ServiceCode="AmazonEC2", Filters=filters)
    except Exception as e:  # noqa: BLE001 the SDK's error, translated (p._fail)
        raise p._fail(e, f"read the on-demand prices of {region} (Price List GetProducts)") from None
    out: dict[str, float] = {}
    for page in pages:
        for text in page.get("PriceList", []):
            doc = json.loads(text) if isinstance(text, str) else text
            itype = doc.get("product", {}).get("attributes", {}).get("instanceType")
            if itype not in instance_types:
                continue
            for term in (doc.get("terms", {}).get("OnDemand") or {}).values():
                for dim in (term.get("priceDimensions") or {}).values():
                    usd = float((dim.get("pricePerUnit") or {}).get("USD", 0) or 0)
                    if dim.get("unit") == "Hrs" and usd > 0:
                        out[itype] = min(usd, out.get(itype, usd))
    return out


# ------------------------------------------------------------------------------------ GCP


def gcp_rows(regions: list[str] | None = None, *, workers: int = 16, provider=None,
             progress: Callable[[str], None] | None = None) -> tuple[list[dict], list[str]]:
    """``(catalog rows, the regions read)``: every GPU machine GCP sells in ``regions`` (None:
    every region with an ``UP`` zone; names without one are skipped). See the module docstring.

    Raises:
        CredentialsError: no usable Google credentials or project (exit 4).
        ProviderError: a call failed after the throttling retries (names the call).
    """
    from google.cloud import compute_v1

    from sftctl.catalog.build import GCP_N1_HOSTS
    from sftctl.catalog.identity import from_gce_accelerator_type, kubernetes_labels
    from sftctl.errors import SftctlError
    from sftctl.providers.gcp import GCPProvider

    p = provider or GCPProvider()
    credentials, project = p._resolve()
    as_of, read_at = _now()
    source = _source("GCP APIs: Compute Engine acceleratorTypes and machineTypes per zone; Cloud Billing Catalog "
                     "SKUs (vCPUs + memory + GPUs)", read_at)
    options = {"api_endpoint": p.api_endpoint} if p.api_endpoint else None
    clients = {kind: cls(credentials=credentials, transport="rest", client_options=options) for kind, cls in (
        ("zones", compute_v1.ZonesClient), ("accelerators", compute_v1.AcceleratorTypesClient),
        ("machines", compute_v1.MachineTypesClient))}
    gke = {v: acc for acc, labels in kubernetes_labels().items()
           for v in labels.get("cloud.google.com/gke-accelerator", [])}

    def accelerator(gce_type: str) -> str:
        return from_gce_accelerator_type(gce_type) or gke.get(gce_type, "")

    def call(what: str, fn):
        try:
            return p._call(fn)
        except SftctlError:
            raise
        except Exception as e:  # noqa: BLE001 the SDK's error, translated (p._api_error)
            raise p._api_error(e, what) from None

    zones = call("list the zones", lambda: [z for z in clients["zones"].list(project=project) if z.status == "UP"])
    wanted = set(regions) if regions else None
    zones = sorted(z.name for z in zones if wanted is None or z.name.rsplit("-", 1)[0] in wanted)
    read = sorted({z.rsplit("-", 1)[0] for z in zones})
    n1 = set(GCP_N1_HOSTS.values())

    def zone_types(zone: str) -> tuple[str, list, dict]:
        accs = call(f"list the accelerator types of {zone}",
                    lambda: {a.name: a.maximum_cards_per_instance for a in clients["accelerators"].list(project=project, zone=zone)})
        machines = call(f"list the machine types of {zone}",
                        lambda: [m for m in clients["machines"].list(project=project, zone=zone)
                                 if m.accelerators or m.name in n1])
        return zone, machines, accs

    skus = _gce_skus(p, call)
    rows: dict[tuple[str, str], dict] = {}
    for zone, machines, accs in _pool(workers, zone_types, zones):
        region = zone.rsplit("-", 1)[0]
        for m in machines:
            if m.accelerators:
                pairs = [(m.name, m.accelerators[0].guest_accelerator_type, m.accelerators[0].guest_accelerator_count)]
            else:  # an N1 host: the T4/V100 counts sftctl pairs with it, where the zone has them
                by_name = {"T4": "nvidia-tesla-t4", "V100": "nvidia-tesla-v100"}
                pairs = [(f"{m.name}+{gpu}", by_name[gpu], c) for (gpu, c), host in GCP_N1_HOSTS.items()
                         if host == m.name and by_name[gpu] in accs and c <= accs[by_name[gpu]]]
            for itype, gce_type, count in pairs:
                acc = accelerator(gce_type)
                if not acc:
                    continue
                price = _gce_price(skus, "OnDemand", m.name, region, m.guest_cpus, m.memory_mb / 1024, gce_type, count)
                if price is None:
                    continue
                spot = _gce_price(skus, "Preemptible", m.name, region, m.guest_cpus, m.memory_mb / 1024, gce_type, count)
                bw = _bandwidth(itype, count, None, "")
                if bw is None:
                    bw = ((_PCIE_ASSUMED[0] if count > 1 else ""), repr(10e9 / 8),
                          f"assumed 10 Gbps network{'; ' + str(count) + ' ' + _PCIE_ASSUMED[1] if count > 1 else ''} "
                          "(no published figure in sftctl's table)")
                key = (itype, region)
                cur = rows.setdefault(key, {"args": (acc, count, m.guest_cpus, m.memory_mb / 1024, price, bw), "zones": {}})
                if spot is not None:
                    cur["zones"][zone] = spot
    out = []
    for (itype, region), v in sorted(rows.items()):
        acc, count, vcpus, mem, price, bw = v["args"]
        out.append(_row("gcp", itype, acc, count, vcpus, mem, region, price, v["zones"], bw, as_of, source))
    if progress:
        progress(f"gcp: {len(out)} offerings in {len({r['region'] for r in out})} regions")
    return out, read


def _gce_skus(p, call) -> dict:
    """``{(usage type, "gpu"|"core"|"ram", gce type or family, region): USD per unit-hour}`` of the
    Compute Engine SKUs (Cloud Billing Catalog API)."""
    from google.cloud import billing_v1

    credentials, _ = p._resolve()
    options = {"api_endpoint": p.api_endpoint} if p.api_endpoint else None
    client = billing_v1.CloudCatalogClient(credentials=credentials, transport="rest", client_options=options)
    skus = call("list the Compute Engine SKUs (Cloud Billing Catalog)",
                lambda: list(client.list_skus(request={"parent": GCE_BILLING_SERVICE, "currency_code": "USD"})))
    out: dict[tuple, float] = {}
    for sku in skus:
        usage = sku.category.usage_type
        if sku.category.resource_family != "Compute" or usage not in ("OnDemand", "Preemptible") or not sku.pricing_info:
            continue
        rates = sku.pricing_info[0].pricing_expression.tiered_rates
        if not rates:
            continue
        rate = min(rates, key=lambda r: r.start_usage_amount)
        usd = rate.unit_price.units + rate.unit_price.nanos / 1e9
        desc = sku.description
        gpu = _GPU_SKU.search(desc) if sku.category.resource_group == "GPU" else None
        core_ram = None if gpu else _CORE_RAM_SKU.match(desc)
        if gpu and gpu.group("model") in GCE_GPU_SKUS:
            key = ("gpu", GCE_GPU_SKUS[gpu.group("model")])
        elif core_ram:
            key = (core_ram.group("kind").lower(), core_ram.group("family").strip())
        else:
            continue
        for region in sku.service_regions:
            out[(usage, key[0], key[1], region)] = usd
    return out


def _gce_price(skus: dict, usage: str, machine: str, region: str, vcpus: float, memory_gib: float,
               gce_type: str, count: int) -> float | None:
    """vCPUs x core + GiB x RAM + GPUs x GPU of ``machine``'s family in ``region``, or None when a
    SKU is missing. A3's variants (Mega, Ultra, Edge) take their own SKUs where the catalog has them."""
    prefix, _, rest = machine.partition("-")
    variant = rest.split("-")[0].replace("gpu", "").capitalize()
    families = [f"{prefix.upper()} {variant}", prefix.upper()]

    def rate(kind: str) -> float | None:
        return next((skus[(usage, kind, f, region)] for f in families if (usage, kind, f, region) in skus), None)

    core, ram, gpu = rate("core"), rate("ram"), skus.get((usage, "gpu", gce_type, region))
    if core is None or ram is None or gpu is None:
        return None
    return vcpus * core + memory_gib * ram + count * gpu
