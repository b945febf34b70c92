"""An HTTP reverse proxy in front of moto's server that answers some EC2 / STS calls with the errors
AWS really returns, so the AWS provider's failover, throttling and credentials paths run over HTTP.

Error bodies and HTTP statuses follow the EC2 API Reference ("Error codes for the Amazon EC2 API",
https://docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html): client errors come
with a 4xx status, server errors (``InsufficientInstanceCapacity``, ``InternalError``) with a 5xx;
``RequestLimitExceeded`` is answered with 503 (the status EC2 sends, as SDK error reports show:
"Status Code: 503; Error Code: RequestLimitExceeded"); ``AuthFailure`` with 401. EC2's error
document is ``<Response><Errors><Error><Code/><Message/></Error></Errors><RequestID/></Response>``;
STS (the AWS Query protocol) answers ``<ErrorResponse><Error><Type/><Code/><Message/></Error>
<RequestId/></ErrorResponse>``, ``InvalidClientTokenId`` with 403.

Everything else is forwarded to moto unchanged.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ICE_MESSAGE = ("We currently do not have sufficient {itype} capacity in the Availability Zone you requested "
               "({zone}). Our system will be working on provisioning additional capacity. You can currently get "
               "{itype} capacity by not specifying an Availability Zone in your request or choosing other zones.")
VCPU_MESSAGE = ("You have requested more vCPU capacity than your current vCPU limit of 0 allows for the instance "
                "bucket that the specified instance type belongs to. Please visit "
                "http://aws.amazon.com/contact-us/ec2-request to request an adjustment to this limit.")


def ec2_error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Response><Errors><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error></Errors><RequestID>{uuid.uuid4()}</RequestID></Response>").encode()


def query_error(code: str, message: str, kind: str = "Sender") -> bytes:
    return (f'<ErrorResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/"><Error><Type>{kind}</Type>'
            f"<Code>{code}</Code><Message>{message}</Message></Error><RequestId>{uuid.uuid4()}</RequestId>"
            "</ErrorResponse>").encode()


class FaultProxy:
    """What to inject. Attributes may be changed while the proxy runs.

    Attributes:
        blocked: ``(instance_type, zone)`` pairs whose RunInstances get InsufficientInstanceCapacity (500).
        throttle_run_instances: the next this-many RunInstances get RequestLimitExceeded (503).
        run_error: ``(code, status, message)`` every RunInstances gets, or None.
        auth_failure: every call is refused: STS with InvalidClientTokenId (403), EC2 with AuthFailure (401).
        run_delay_s: RunInstances is held this long before it is forwarded.
        hold_run_instances_after: RunInstances after the first this-many wait (``held`` counts
            them) until ``release`` is set; None: none wait. A test holds a client mid-provisioning
            this way, whatever the machine's speed.
        delay_s: other actions held before they are forwarded, ``{action: seconds}``.
        actions: ``(action, params)`` of every request seen, in order.
    """

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.blocked: set[tuple[str, str]] = set()
        self.throttle_run_instances = 0
        self.run_error: tuple[str, int, str] | None = None
        self.auth_failure = False
        self.run_delay_s = 0.0
        self.delay_s: dict[str, float] = {}
        self.hold_run_instances_after: int | None = None
        self.release = threading.Event()
        self.held = 0  # RunInstances waiting for `release` now
        self.actions: list[tuple[str, dict]] = []
        self.inflight = 0  # requests being answered now
        self.lock = threading.Lock()
        self.url = ""
        #: called with (service, params, headers, body) before anything else; a (status,
        #: content type, payload) it returns is the answer (tests/aws_prices.py serves prices)
        self.intercept = None

    def run_instances(self) -> list[dict]:
        """The parameters of every RunInstances seen (answered or not)."""
        with self.lock:
            return [p for a, p in self.actions if a == "RunInstances"]

    def fault(self, service: str, action: str, params: dict) -> tuple[int, bytes] | None:
        """The (status, body) to answer instead of moto, or None to forward."""
        hold = False
        with self.lock:
            self.actions.append((action, params))
            if self.auth_failure:
                if service == "sts":
                    return 403, query_error("InvalidClientTokenId", "The security token included in the request is invalid.")
                return 401, ec2_error("AuthFailure", "AWS was not able to validate the provided access credentials")
            if action != "RunInstances":
                delay = self.delay_s.get(action, 0.0)
            elif self.throttle_run_instances > 0:
                self.throttle_run_instances -= 1
                return 503, ec2_error("RequestLimitExceeded", "Request limit exceeded.")
            elif self.run_error:
                code, status, message = self.run_error
                return status, ec2_error(code, message)
            else:
                itype, zone = params.get("InstanceType", ""), params.get("Placement.AvailabilityZone", "")
                if (itype, zone) in self.blocked:
                    return 500, ec2_error("InsufficientInstanceCapacity", ICE_MESSAGE.format(itype=itype, zone=zone))
                delay = self.run_delay_s
                seen = sum(a == "RunInstances" for a, _ in self.actions)
                hold = self.hold_run_instances_after is not None and seen > self.hold_run_instances_after
                if hold:
                    self.held += 1
        if delay:
            time.sleep(delay)
        if action == "RunInstances" and hold:
            try:
                self.release.wait()
            finally:
                with self.lock:
                    self.held -= 1
        return None


def _handler(proxy: FaultProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _handle(self):
            with proxy.lock:
                proxy.inflight += 1
            try:
                self._answer()
            finally:
                with proxy.lock:
                    proxy.inflight -= 1

        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if len(body) < length:
                # the client died mid-request (a test's kill -9): AWS drops such a request. Passing
                # it on with its Content-Length would leave moto waiting for the rest of the body
                # until the upstream timeout (60 s), the request "in flight" all that while.
                self.close_connection = True
                return
            params = {}
            if "x-www-form-urlencoded" in (self.headers.get("Content-Type") or ""):
                params = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode(), keep_blank_values=True).items()}
            auth = self.headers.get("Authorization", "")
            scope = auth.split("Credential=", 1)[1].split(",", 1)[0].split("/") if "Credential=" in auth else []
            service = scope[3] if len(scope) > 3 else ""
            answer = proxy.intercept(service, params, self.headers, body) if proxy.intercept else None
            answer = answer or proxy.fault(service, params.get("Action", ""), params)
            if answer is not None:
                status, payload, *kind = answer
                self.send_response(status)
                self.send_header("Content-Type", kind[0] if kind else "text/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            finally:
                conn.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

    return Handler


@contextlib.contextmanager
def fault_proxy(upstream: str):
    """Run a :class:`FaultProxy` in front of ``upstream`` (moto's URL) on a free loopback port."""
    proxy = FaultProxy(upstream)
    server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})  # default backlog: 5
    server = server_class(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        proxy.release.set()  # nothing stays held past the test
        server.shutdown()
        server.server_close()
