"""Seeded AWS prices for ``sftctl catalog refresh``, served through :class:`aws_faults.FaultProxy`.

moto's server answers the EC2 calls the refresh makes (``DescribeRegions``,
``DescribeInstanceTypes``, ``DescribeInstanceTypeOfferings``) from AWS's own instance data. Two
calls it cannot answer usefully are served here instead, through the proxy's ``intercept`` hook:

* ``DescribeSpotPriceHistory``: moto answers a constant ``0.00001`` for every zone. Here each
  ``(instance type, zone)`` of the seed gets its price (zones moto does not offer the type in are
  answered too; the refresh must keep only offered zones). The XML is EC2's (API Reference,
  ``DescribeSpotPriceHistory`` response elements) and is checked by parsing it with botocore's
  own EC2 parser against the operation's output shape.
* The Price List Query API's ``GetProducts`` (JSON 1.1, ``X-Amz-Target:
  AWSPriceListService.GetProducts``), which moto does not implement: requests are checked against
  botocore's ``pricing`` service model (members, filter types), ``TERM_MATCH`` filters select the
  seeded products, and each answer is validated against the output shape before it is sent. The
  price documents follow AWS's price list format (``product.attributes``, ``terms.OnDemand.*.
  priceDimensions.*.pricePerUnit.USD``, unit ``Hrs``).

Faults: ``throttle_pricing`` answers the next n GetProducts with ``ThrottlingException`` (HTTP
400, as the Price List API does); ``deny_pricing`` answers every GetProducts with
``AccessDeniedException``.
"""

from __future__ import annotations

import datetime
import json
import threading
import uuid

import botocore.session
from botocore.parsers import create_parser
from botocore.validate import validate_parameters

_SESSION = botocore.session.get_session()
_PRICING = _SESSION.get_service_model("pricing").operation_model("GetProducts")
_SPOT = _SESSION.get_service_model("ec2").operation_model("DescribeSpotPriceHistory")


class PriceSeed:
    """The prices AWS would answer.

    Args:
        on_demand: ``{(instance type, region): USD per hour}`` (Linux, shared tenancy).
        spot: ``{(instance type, zone name): USD per hour}``.
    """

    def __init__(self, on_demand: dict[tuple[str, str], float], spot: dict[tuple[str, str], float]):
        self.on_demand = dict(on_demand)
        self.spot = dict(spot)
        self.throttle_pricing = 0
        self.deny_pricing = False
        self.calls: list[str] = []
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ the proxy hook

    def __call__(self, service: str, params: dict, headers, body: bytes):
        target = headers.get("X-Amz-Target", "")
        if target.startswith("AWSPriceListService."):
            return self._pricing(target.split(".", 1)[1], json.loads(body or b"{}"))
        if params.get("Action") == "DescribeSpotPriceHistory":
            auth = headers.get("Authorization", "")
            scope = auth.split("Credential=", 1)[1].split(",", 1)[0].split("/") if "Credential=" in auth else []
            return self._spot(params, scope[2] if len(scope) > 2 else "")
        return None

    # ------------------------------------------------------------------ Price List

    @staticmethod
    def _json_error(status: int, kind: str, message: str):
        return status, json.dumps({"__type": kind, "message": message}).encode(), "application/x-amz-json-1.1"

    def _pricing(self, operation: str, request: dict):
        with self.lock:
            self.calls.append(f"pricing.{operation}")
            if self.deny_pricing:
                return self._json_error(400, "AccessDeniedException", "User is not authorized to perform: pricing:GetProducts")
            if self.throttle_pricing > 0:
                self.throttle_pricing -= 1
                return self._json_error(400, "ThrottlingException", "Rate exceeded")
        if operation != "GetProducts":
            return self._json_error(400, "UnknownOperationException", operation)
        try:  # the request must be one botocore's model allows
            validate_parameters(request, _PRICING.input_shape)
        except Exception as e:  # noqa: BLE001 - any validation failure is the client's 400
            return self._json_error(400, "ValidationException", " ".join(str(e).split()))
        terms = {}
        for f in request.get("Filters", []):
            if f["Type"] != "TERM_MATCH":
                return self._json_error(400, "InvalidParameterException", f"filter type {f['Type']} is not served here")
            terms[f["Field"]] = f["Value"]
        fixed = {"operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used"}
        items = []
        for (itype, region), usd in sorted(self.on_demand.items()):
            attrs = {"instanceType": itype, "regionCode": region, **fixed}
            if request.get("ServiceCode") == "AmazonEC2" and all(attrs.get(k) == v for k, v in terms.items()):
                items.append(json.dumps(self._product(itype, region, usd, attrs)))
        start = int(request.get("NextToken") or 0)
        size = int(request.get("MaxResults") or 100)
        out = {"FormatVersion": "aws_v1", "PriceList": items[start:start + size]}
        if start + size < len(items):
            out["NextToken"] = str(start + size)
        validate_parameters(out, _PRICING.output_shape)
        return 200, json.dumps(out).encode(), "application/x-amz-json-1.1"

    @staticmethod
    def _product(itype: str, region: str, usd: float, attrs: dict) -> dict:
        sku = uuid.uuid5(uuid.NAMESPACE_URL, f"{itype}/{region}").hex[:16].upper()
        return {"product": {"productFamily": "Compute Instance", "sku": sku,
                            "attributes": {"servicecode": "AmazonEC2", **attrs}},
                "serviceCode": "AmazonEC2", "version": "20261201000000", "publicationDate": "2026-12-01T00:00:00Z",
                "terms": {"OnDemand": {f"{sku}.JRTCKXETXF": {
                    "offerTermCode": "JRTCKXETXF", "sku": sku, "effectiveDate": "2026-12-01T00:00:00Z",
                    "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                        "unit": "Hrs", "beginRange": "0", "endRange": "Inf", "rateCode": f"{sku}.JRTCKXETXF.6YS6EN2CT7",
                        "description": f"${usd} per On Demand Linux {itype} Instance Hour",
                        "pricePerUnit": {"USD": f"{usd:.10f}"}}}}}}}

    # ------------------------------------------------------------------ EC2 spot history

    def _spot(self, params: dict, region: str):
        with self.lock:
            self.calls.append("ec2.DescribeSpotPriceHistory")
        types = {v for k, v in params.items() if k.startswith("InstanceType.")}
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        items = "".join(
            f"<item><instanceType>{itype}</instanceType><productDescription>Linux/UNIX</productDescription>"
            f"<spotPrice>{usd:.6f}</spotPrice><timestamp>{now}</timestamp><availabilityZone>{zone}</availabilityZone></item>"
            for (itype, zone), usd in sorted(self.spot.items()) if (not types or itype in types)
            and zone[:-1] == region)  # zone names are the region's name and a letter
        payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<DescribeSpotPriceHistoryResponse '
                   f'xmlns="http://ec2.amazonaws.com/doc/2016-11-15/"><requestId>{uuid.uuid4()}</requestId>'
                   f"<spotPriceHistorySet>{items}</spotPriceHistorySet><nextToken></nextToken>"
                   "</DescribeSpotPriceHistoryResponse>").encode()
        parsed = create_parser("ec2").parse({"body": payload, "headers": {}, "status_code": 200}, _SPOT.output_shape)
        assert len(parsed["SpotPriceHistory"]) == items.count("<item>"), "spot answer does not parse as EC2's"
        return 200, payload, "text/xml;charset=UTF-8"
