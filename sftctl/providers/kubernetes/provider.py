"""The Kubernetes provider: :class:`KubernetesProvider` (see :mod:`sftctl.providers.kubernetes`),
the API's errors in one line, and a pod's status."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
import json
import os
import threading
import time

from sftctl import settings
from sftctl.catalog import Offering
from sftctl.errors import CapacityError, CredentialsError, ProviderError, SftctlError
from sftctl.health.platform import kept_out_note, listed_unhealthy_hosts, node_problem
from sftctl.providers.cloud import (
    JOB_LABEL,
    MANAGED_LABEL,
    NODE_LABEL,
    READY_TIMEOUT_S,
    CloudProvider,
    InstanceRequest,
    InstanceState,
    label_value,
    retry_throttled,
)
from sftctl.providers.kubernetes.manifests import (
    _HINT,
    CONTROLLER_OF_LABEL,
    CONTROLLER_ROLE_LABEL,
    CORDON_REASON,
    CORDONED_AT,
    CORDONED_BY,
    DEFAULT_IMAGES,
    HOSTNAME_LABEL,
    PENDING_TIMEOUT_S,
    POOL_LABELS,
    _quantity,
    controller_manifests,
    controller_names,
    names,
    node_accelerator,
    node_manifests,
)
from sftctl.types import KubernetesHandle


def _status_message(e) -> str:
    """The one-line message of an ``ApiException`` (its ``Status`` body's message when there is one)."""
    text = ""
    try:
        body = json.loads(e.body or "")
        text = body.get("message") or body.get("reason") or ""
    except (TypeError, ValueError, AttributeError):
        text = (e.body or "") if isinstance(e.body, str) else ""
    text = text or str(e.reason or "")
    return " ".join(str(text).split())[:500]


def _is_throttle(e: BaseException) -> bool:
    """Whether ``e`` is the API server's 429 TooManyRequests (API Priority and Fairness)."""
    from kubernetes.client.exceptions import ApiException

    return isinstance(e, ApiException) and e.status == 429


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


class KubernetesProvider(CloudProvider[KubernetesHandle]):
    """Nodes as pods on a Kubernetes cluster. See the module docstring.

    Args:
        channel, poll_s, ready_timeout_s: as for :class:`CloudProvider`.
        context: the kubeconfig context (default: ``SFTCTL_K8S_CONTEXT``, else the current context).
        namespace: where the objects go (default: ``SFTCTL_K8S_NAMESPACE``, else the context's
            namespace, else ``default``).
        pending_timeout_s: how long a pod may stay unscheduled before its offering counts as out
            of capacity (:class:`CapacityError`, scope ``offering``).
        image: the container image when the spec names none (default :data:`DEFAULT_IMAGES`).
        api_client: a ready ``kubernetes.client.ApiClient`` (instead of the kubeconfig).
        kubeconfig: a kubeconfig path (default: ``KUBECONFIG``, else ``~/.kube/config``; in a pod
            without one, the in-cluster service account).
        prices: USD per accelerator-hour by ``instance_type`` or accelerator name (a cluster's
            internal chargeback rate); an offering costs rate x count. Unpriced: 0.0.
        secrets: environment variables for every pod of a job, delivered through a Secret
            (``envFrom``); a request's own ``secrets`` attribute, when it has one, is added.
        num_nodes: the job's node count for ``NNODES`` (a request's ``num_nodes`` wins).
    """

    name = "kubernetes"
    handle_type = KubernetesHandle

    @classmethod
    def for_plan(cls, spec=None) -> "KubernetesProvider":
        """The provider the planner asks for the cluster's offerings
        (:class:`~sftctl.providers.base.LiveOfferings`): the kubeconfig's, whatever the spec."""
        return cls()

    def __init__(self, channel=None, poll_s: float = 2.0, ready_timeout_s: float = READY_TIMEOUT_S,
                 context: str | None = None, namespace: str | None = None,
                 pending_timeout_s: float = PENDING_TIMEOUT_S, image: str | None = None, api_client=None,
                 kubeconfig: str | None = None, prices: dict[str, float] | None = None,
                 secrets: dict[str, str] | None = None, num_nodes: int | None = None, **_):
        super().__init__(channel=channel, poll_s=poll_s, ready_timeout_s=ready_timeout_s)

        self.context = context or settings.get("SFTCTL_K8S_CONTEXT")
        self._namespace = namespace or settings.get("SFTCTL_K8S_NAMESPACE")
        self.pending_timeout_s = pending_timeout_s
        self.image = image
        self.kubeconfig = kubeconfig
        self.prices = dict(prices or {})
        self.secrets = dict(secrets or {})
        self.num_nodes = num_nodes
        self._api_client = api_client
        self._region = self.context or ("cluster" if api_client is not None else None)
        self._lock = threading.Lock()
        self._job_locks: dict[tuple[str, str], threading.Lock] = {}
        self._job_objects: set[tuple[str, str]] = set()  # (namespace, job) whose Service/Secret exist
        self.avoid_hosts: dict[str, set[str]] = {}  # job -> hostnames its next pods avoid (quarantine)

    # ---------------------------------------------------------------- configuration

    def _client(self):
        """The ``ApiClient`` (built once from the kubeconfig or the in-cluster service account)."""
        with self._lock:
            if self._api_client is None:
                self._api_client = self._load_config()
            return self._api_client

    def _load_config(self):
        from kubernetes import client, config

        path = self.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        paths = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
        if any(os.path.isfile(p) for p in paths):
            joined = os.pathsep.join(paths)
            try:
                contexts, active = config.list_kube_config_contexts(config_file=joined)
                wanted = self.context or (active or {}).get("name")
                chosen = next((c for c in contexts or [] if c.get("name") == wanted), None)
                if chosen is None:
                    known = ", ".join(c.get("name", "?") for c in contexts or []) or "none"
                    raise CredentialsError(f"kubernetes: context {wanted!r} is not in the kubeconfig {path} "
                                           f"(contexts: {known})", hint=_HINT)
                configuration = client.Configuration()
                config.load_kube_config(config_file=joined, context=wanted, client_configuration=configuration,
                                        persist_config=False)
            except CredentialsError:
                raise
            except Exception as e:  # noqa: BLE001 ConfigException, YAML errors, a file that is not a kubeconfig
                raise CredentialsError(f"kubernetes: the kubeconfig {path} is not usable: {_one_line(e)}",
                                       hint=_HINT) from None
            self.context = wanted
            self._region = wanted
            if self._namespace is None:
                self._namespace = (chosen.get("context") or {}).get("namespace") or None
            return client.ApiClient(configuration)
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            configuration = client.Configuration()
            try:
                config.load_incluster_config(client_configuration=configuration)
            except Exception as e:  # noqa: BLE001 whatever it raises: the service account is not usable
                raise CredentialsError(f"kubernetes: the in-cluster service account is not usable: {_one_line(e)}",
                                       hint=_HINT) from None
            self._region = self._region or "cluster"
            if self._namespace is None:
                ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
                if os.path.isfile(ns_file):
                    self._namespace = open(ns_file).read().strip() or None
            return client.ApiClient(configuration)
        raise CredentialsError(f"kubernetes: no kubeconfig at {path} and not running in a cluster", hint=_HINT)

    @property
    def namespace(self) -> str:
        self._client()
        return self._namespace or "default"

    @property
    def region(self) -> str:
        """The offerings' region: the kubeconfig context's name, or ``cluster``."""
        self._client()
        return self._region or "cluster"

    def _core(self):
        from kubernetes import client

        return client.CoreV1Api(self._client())

    # ---------------------------------------------------------------- API calls

    def _call(self, what: str, fn, *args, allow: tuple[int, ...] = (), offering: Offering | None = None, **kw):
        """``fn(*args, **kw)`` with 429 retried; an API error as an sftctl error.

        Returns None when the API answered with a status in ``allow`` (404 on delete, 409 on create).
        """
        from kubernetes.client.exceptions import ApiException

        kw.setdefault("_preload_content", False)  # raw JSON: no model parsing, any client version
        call = retry_throttled(_is_throttle)(fn)
        try:
            return call(*args, **kw)
        except ApiException as e:
            if e.status in allow:
                return None
            raise self._error(e, what, offering) from None
        except (CredentialsError, ProviderError):
            raise
        except Exception as e:  # urllib3: connection refused, DNS, TLS
            if type(e).__module__.startswith(("urllib3", "ssl", "socket")) or isinstance(e, OSError):
                host = getattr(getattr(self._client(), "configuration", None), "host", "?")
                raise ProviderError(f"kubernetes: cannot reach the API server at {host} ({what}): {_one_line(e)}",
                                    hint=_HINT) from None
            raise

    def _json(self, what: str, fn, *args, allow: tuple[int, ...] = (), **kw) -> dict | None:
        """Like :meth:`_call` for a read, answering the raw JSON (camelCase dicts, any client version)."""
        resp = self._call(what, fn, *args, allow=allow, **kw)
        return None if resp is None else json.loads(resp.data or b"{}")

    def _error(self, e, what: str, offering: Offering | None = None) -> Exception:
        message = _status_message(e)
        where = f"context {self._region}" if self._region else "the cluster"
        if e.status == 401:
            return CredentialsError(f"kubernetes: {where} rejected the credentials ({what}: 401 Unauthorized)",
                                    hint=_HINT + "; refresh an expired token")
        if e.status == 403 and "exceeded quota" in message:
            return CapacityError(
                f"kubernetes: {what}: {message}", provider=self.name, scope="region", region=self.region,
                instance_type=offering.instance_type if offering else None, code="ExceededQuota",
                hint="a ResourceQuota of the namespace is used up: free GPUs or raise the quota")
        if e.status == 403:
            return CredentialsError(f"kubernetes: {what} forbidden in namespace {self.namespace}: {message}",
                                    hint="grant the user RBAC rights on pods, services, configmaps, secrets "
                                         "(and nodes: list, patch), or " + _HINT)
        if e.status == 429:
            return ProviderError(f"kubernetes: {what}: still throttled (429) after retries: {message}",
                                 hint="the API server is overloaded; retry later")
        return ProviderError(f"kubernetes: {what} failed ({e.status} {e.reason}): {message}",
                             hint="see the message; `kubectl get events` may say more")

    # ---------------------------------------------------------------- the CloudProvider half

    def check(self) -> None:
        """Load the configuration and make one authenticated call (list pods, limit 1).

        Raises:
            CredentialsError: no or an invalid kubeconfig, a missing context, 401 or 403.
            ProviderError: the API server cannot be reached.
        """
        self._call("list pods", self._core().list_namespaced_pod, self.namespace, limit=1)

    def offerings(self, accelerator: str, count: int) -> list[Offering]:
        """One offering per node pool (or GPU product) with a node of >= ``count`` ``accelerator``.

        ``accelerator`` ``cpu`` is offered by ready nodes without GPUs with >= ``count`` CPUs.
        Cordoned and NotReady nodes are left out. Prices come from the constructor's ``prices``.
        """
        items = (self._json("list nodes", self._core().list_node) or {}).get("items") or []
        best: dict[str, dict] = {}
        for node in items:
            if (node.get("spec") or {}).get("unschedulable") or not _ready(node) or node_problem(node):  # 41.4
                continue
            name, product, gpus = node_accelerator(node)
            alloc = (node.get("status") or {}).get("allocatable") or {}
            node_labels = (node.get("metadata") or {}).get("labels") or {}
            if accelerator.lower() == "cpu":
                if name != "cpu" or _quantity(alloc.get("cpu", "0")) < count:
                    continue
            elif name.lower() != accelerator.lower() or gpus < count:
                continue
            pool = next((node_labels[k] for k in POOL_LABELS if node_labels.get(k)), None)
            instance_type = pool or product or node_labels.get("node.kubernetes.io/instance-type") or "cpu"
            seen = best.get(instance_type)
            if seen is None or _quantity(alloc.get("cpu", "0")) > seen["cpu"]:
                best[instance_type] = {"name": name, "cpu": _quantity(alloc.get("cpu", "0")),
                                       "memory": _quantity(alloc.get("memory", "0"))}
        out = []
        for instance_type, info in sorted(best.items()):
            rate = self.prices.get(instance_type, self.prices.get(info["name"], 0.0))
            price = float(rate) * count
            out.append(Offering(
                provider=self.name, instance_type=instance_type, accelerator=info["name"], count=count,
                region=self.region, usd_per_hour=price, spot_usd_per_hour=price,
                vcpus=int(info["cpu"]) or None, memory_gib=round(info["memory"] / 2**30, 1) or None,
                source=f"kubernetes node labels and allocatable resources ({self.region})"
                       + ("; price from the sftctl price table" if rate else "; no price given: $0/h")
                       + kept_out_note(items),  # issue 41.4: what HyperPod / NVSentinel keep out
                as_of=datetime.date.today().isoformat(),
            ))
        return out

    def zones(self, region: str) -> list[str | None]:
        """A cluster has no zones sftctl chooses: one pass, zone None."""
        return [None]

    def create_instance(self, request: InstanceRequest) -> KubernetesHandle:
        """Create the job's Secret and Service (once per job), then the node's ConfigMap and Pod.

        Raises:
            CapacityError: a ResourceQuota is used up (scope ``region``).
            CredentialsError, ProviderError: see :meth:`_error`.
        """
        ns = self.namespace
        secrets = {**self.secrets, **(getattr(request, "secrets", None) or {})}
        num_nodes = getattr(request, "num_nodes", None) or self.num_nodes
        with self._lock:
            avoid = sorted(self.avoid_hosts.get(request.job_id, ()))
        avoid = sorted({*avoid, *listed_unhealthy_hosts(lambda: self._json("list nodes", self._core().list_node))})
        objs = node_manifests(request, namespace=ns, secrets=secrets, image=self.image, num_nodes=num_nodes,
                              avoid_hosts=avoid)
        core = self._core()
        self._ensure_job_objects(request, ns, objs)
        pod, cm = objs["pod"]["metadata"]["name"], objs["configmap"]["metadata"]["name"]
        self._call(f"create configmap {cm}", core.create_namespaced_config_map, ns, objs["configmap"],
                   allow=(409,), offering=request.offering)
        try:
            self._call(f"create pod {pod}", core.create_namespaced_pod, ns, objs["pod"], allow=(409,),
                       offering=request.offering)
        except Exception:  # leave nothing behind: the ConfigMap, and the job's objects if no pod uses them
            try:
                self._call(f"delete configmap {cm}", core.delete_namespaced_config_map, cm, ns, allow=(404,))
                self._release_job_objects(ns, request.job_id, pod)
            except Exception:  # noqa: BLE001 best effort: the create's error is the one to report (terminate_tagged sweeps)
                pass
            raise
        n = names(request.job_id, request.node_id, request.rank)
        return KubernetesHandle(
            job_id=request.job_id, node_id=request.node_id, rank=request.rank,
            id=pod, pod=pod, configmap=cm, service=n["service"],
            secret=n["secret"] if secrets else None, namespace=ns, context=self._region,
            hostname=n["hostname"], ip=f"{n['hostname']}.{n['service']}",
            region=request.offering.region, instance_type=request.offering.instance_type,
            accelerator=request.offering.accelerator,
        )

    def _ensure_job_objects(self, request: InstanceRequest, ns: str, objs: dict) -> None:
        """Create the job's Secret and Service unless this provider already did (409 is fine)."""
        key = (ns, request.job_id)
        with self._lock:
            lock = self._job_locks.setdefault(key, threading.Lock())
        with lock:
            if key in self._job_objects:
                return
            core = self._core()
            if objs["secret"] is not None:
                name = objs["secret"]["metadata"]["name"]
                made = self._call(f"create secret {name}", core.create_namespaced_secret, ns, objs["secret"],
                                  allow=(409,), offering=request.offering)
                if made is None:  # left by an earlier run: bring its values up to date
                    self._call(f"patch secret {name}", core.patch_namespaced_secret, name, ns,
                               {"data": objs["secret"]["data"]}, offering=request.offering)
            svc = objs["service"]["metadata"]["name"]
            self._call(f"create service {svc}", core.create_namespaced_service, ns, objs["service"],
                       allow=(409,), offering=request.offering)
            self._job_objects.add(key)

    def _read_pod(self, handle: KubernetesHandle) -> dict | None:
        """The pod of ``handle`` as the API's JSON, or None when it is gone."""
        return self._json(f"read pod {handle.pod}", self._core().read_namespaced_pod, handle.pod,
                          handle.namespace or self.namespace, allow=(404,))

    def describe(self, handle: KubernetesHandle) -> InstanceState:
        """Pending -> PENDING; Running -> RUNNING; Succeeded, Failed, Unknown or being deleted ->
        STOPPING; not found -> GONE. (An unschedulable pod fails in :meth:`wait_ready`.)"""
        return _pod_state(self._read_pod(handle))

    def wait_ready(self, handle: KubernetesHandle) -> KubernetesHandle:
        """Poll the pod until it runs; return the handle with ``node_name`` and ``pod_ip``.

        Raises:
            CapacityError: the pod stayed unscheduled longer than ``pending_timeout_s`` (scope
                ``offering``; the pod is deleted first), so the controller fails over.
            ProviderError: the pod ended or vanished while starting, could not start its
                container, or did not run within ``ready_timeout_s`` (deleted first).
        """
        start = time.monotonic()
        while True:
            pod = self._read_pod(handle)
            state = _pod_state(pod)
            if state == InstanceState.RUNNING:
                return handle.with_(node_name=pod["spec"].get("nodeName"),
                                    pod_ip=(pod.get("status") or {}).get("podIP"))
            waited = time.monotonic() - start
            why = None
            if state != InstanceState.PENDING:
                why = f"stopped while starting ({_pod_detail(pod)})"
            elif _fatal_wait(pod):
                why = f"could not start its container ({_fatal_wait(pod)})"
            elif not (pod.get("spec") or {}).get("nodeName") and waited > self.pending_timeout_s:
                self.delete_instance(handle)
                message = _unschedulable(pod) or "no scheduling decision yet"
                raise CapacityError(
                    f"kubernetes: pod {handle.pod} was not scheduled within {self.pending_timeout_s:g} s: {message}",
                    provider=self.name, scope="offering", region=handle.region or self.region,
                    instance_type=handle.instance_type, code="Unschedulable",
                    hint="the cluster has no node with enough free GPUs of this kind; sftctl deleted the pod",
                )
            elif waited > self.ready_timeout_s:
                why = f"was not running after {self.ready_timeout_s:g} s ({_pod_detail(pod)})"
            if why is not None:
                self.delete_instance(handle)
                raise ProviderError(f"kubernetes: pod {handle.pod} {why}",
                                    hint="sftctl deleted it; `kubectl describe pod` of a rerun says more")
            time.sleep(self.poll_s)

    def delete_instance(self, handle: KubernetesHandle) -> None:
        """Delete the node's pod and ConfigMap (already gone is fine); with the job's last pod,
        its Service and Secret too."""
        ns = handle.namespace or self.namespace
        core = self._core()
        pod = handle.pod or handle.id
        self._call(f"delete pod {pod}", core.delete_namespaced_pod, pod, ns, allow=(404,))
        cm = handle.configmap or f"{pod}-bootstrap"
        self._call(f"delete configmap {cm}", core.delete_namespaced_config_map, cm, ns, allow=(404,))
        if handle.job_id:
            self._release_job_objects(ns, handle.job_id, pod, handle.service, handle.secret)

    def _release_job_objects(self, ns: str, job_id: str, gone_pod: str, service: str | None = None,
                             secret: str | None = None) -> None:
        """Delete the job's Service and Secret when no pod of the job but ``gone_pod`` is left."""
        core = self._core()
        selector = f"{MANAGED_LABEL}=true,{JOB_LABEL}={label_value(job_id)}"
        pods = (self._json("list pods", core.list_namespaced_pod, ns, label_selector=selector) or {}).get("items") or []
        if any(p["metadata"]["name"] != gone_pod and not p["metadata"].get("deletionTimestamp") for p in pods):
            return
        key = (ns, job_id)
        with self._lock:
            lock = self._job_locks.setdefault(key, threading.Lock())
        with lock:
            self._job_objects.discard(key)
            n = names(job_id, "", 0)
            self._call(f"delete service {n['service']}", core.delete_namespaced_service, service or n["service"], ns,
                       allow=(404,))
            self._call(f"delete secret {n['secret']}", core.delete_namespaced_secret, secret or n["secret"], ns,
                       allow=(404,))

    def list_instances(self, job_id: str | None = None) -> list[dict]:
        """The sftctl pods of the namespace (of ``job_id`` when given), each a dict with the keys
        of a :class:`KubernetesHandle` (``rank`` None where the pod does not say) and ``state``."""
        ns = self.namespace
        selector = f"{MANAGED_LABEL}=true" + (f",{JOB_LABEL}={label_value(job_id)}" if job_id else "")
        items = (self._json("list pods", self._core().list_namespaced_pod, ns, label_selector=selector)
                 or {}).get("items") or []
        out = []
        for pod in items:
            meta = pod["metadata"]
            lab, ann = meta.get("labels") or {}, meta.get("annotations") or {}
            out.append({
                "id": meta["name"], "pod": meta["name"], "namespace": meta.get("namespace") or ns,
                "configmap": f"{meta['name']}-bootstrap",
                "job_id": ann.get("sftctl.dev/job-id") or lab.get(JOB_LABEL),
                "node_id": ann.get("sftctl.dev/node-id") or lab.get(NODE_LABEL),
                "rank": int(ann["sftctl.dev/rank"]) if str(ann.get("sftctl.dev/rank", "")).isdigit() else None,
                "node_name": (pod.get("spec") or {}).get("nodeName"),
                "state": _pod_state(pod).value,
            })
        return out

    def terminate_tagged(self, job_id: str) -> int:
        """Delete the job's pods, ConfigMaps, Services and Secrets; return how many there were."""
        ns = self.namespace
        core = self._core()
        selector = f"{MANAGED_LABEL}=true,{JOB_LABEL}={label_value(job_id)}"
        kinds = (("pods", core.list_namespaced_pod, core.delete_namespaced_pod),
                 ("configmaps", core.list_namespaced_config_map, core.delete_namespaced_config_map),
                 ("services", core.list_namespaced_service, core.delete_namespaced_service),
                 ("secrets", core.list_namespaced_secret, core.delete_namespaced_secret))
        count = 0
        for kind, list_fn, delete_fn in kinds:
            items = (self._json(f"list {kind}", list_fn, ns, label_selector=selector) or {}).get("items") or []
            for obj in items:
                name = obj["metadata"]["name"]
                self._call(f"delete {kind} {name}", delete_fn, name, ns, allow=(404,))
                count += 1
        with self._lock:
            self._job_objects.discard((ns, job_id))
        return count

    # ---------------------------------------------------------------- a job's controller (controller.place)

    def _batch(self):
        from kubernetes import client

        return client.BatchV1Api(self._client())

    def submit_controller(self, job_id: str, argv: list[str], *, env: dict[str, str],
                          secret_env: dict[str, str], image: str | None = None) -> str:
        """Create the Secret (``secret_env``) and the batch/v1 Job of ``job_id``'s controller
        (:func:`controller_manifests`) in the namespace; return the Job's name. A Job or Secret
        that already exists (409) is taken as this one (idempotent).

        Raises:
            CredentialsError, ProviderError: see :meth:`_error` (exit 4).
        """
        ns = self.namespace
        objs = controller_manifests(job_id, argv, namespace=ns, env=env, secret_env=secret_env,
                                    image=image or self.image or DEFAULT_IMAGES["cpu"])
        name = objs["job"]["metadata"]["name"]
        if objs["secret"] is not None:
            self._call(f"create secret {objs['secret']['metadata']['name']}", self._core().create_namespaced_secret,
                       ns, objs["secret"], allow=(409,))
        self._call(f"create job {name}", self._batch().create_namespaced_job, ns, objs["job"], allow=(409,))
        return name

    def controller_jobs(self, job_id: str | None = None) -> list[dict]:
        """The controller Jobs of the namespace (of ``job_id`` only when given):
        ``[{"id", "job_id", "state", "name"}]`` (state: ``active``, ``succeeded``, ``failed``)."""
        selector = CONTROLLER_ROLE_LABEL + "=controller" + (
            f",{CONTROLLER_OF_LABEL}={label_value(job_id)}" if job_id is not None else "")
        items = (self._json("list jobs", self._batch().list_namespaced_job, self.namespace, label_selector=selector)
                 or {}).get("items") or []
        out = []
        for job in items:
            meta, st = job["metadata"], job.get("status") or {}
            state = "succeeded" if st.get("succeeded") else "failed" if st.get("failed") else "active"
            out.append({"id": meta["name"], "name": meta["name"], "state": state,
                        "job_id": (meta.get("annotations") or {}).get("sftctl.dev/job-id")})
        return out

    def cancel_controller(self, job_id: str, grace_s: float = 20.0) -> list[str]:
        """Delete ``job_id``'s controller Job(s) (propagation ``Background``: its pod gets SIGTERM
        and ``grace_s`` seconds, so the controller cancels the job and stops its nodes) and their
        Secret. Returns the names of the Jobs it found."""
        ns = self.namespace
        found = [f["id"] for f in self.controller_jobs(job_id)]
        for name in found:
            self._call(f"delete job {name}", self._batch().delete_namespaced_job, name, ns, allow=(404,),
                       propagation_policy="Background", grace_period_seconds=max(0, int(grace_s)))
        secret = controller_names(job_id)["secret"]
        self._call(f"delete secret {secret}", self._core().delete_namespaced_secret, secret, ns, allow=(404,))
        return found

    def cordon(self, node_name, reason: str | None = None, by: str | None = None) -> dict | None:
        """Mark a cluster node unschedulable (``kubectl cordon``): a node judged bad gets no new pods.

        ``node_name`` is the node's name, or a :class:`KubernetesHandle` whose ``node_name`` (the
        pod's ``spec.nodeName``, recorded by :meth:`wait_ready`) names it. With ``reason`` the node also
        gets the annotations :data:`CORDON_REASON` (``reason``, at most 1000 characters),
        :data:`CORDONED_BY` (``by``) and :data:`CORDONED_AT` (UTC, ISO 8601), so ``kubectl describe
        node`` says why. One strategic-merge patch; returns the patched node (API JSON), or None
        when the node is gone (404).

        Raises:
            CredentialsError: the user may not patch nodes (403) or the credentials are bad (401).
            ProviderError: the pod was never scheduled, or the API failed.
        """
        if isinstance(node_name, KubernetesHandle):
            node_name = node_name.node_name
        if not node_name:
            raise ProviderError("kubernetes: cordon needs a node name (the pod was never scheduled)")
        body: dict = {"spec": {"unschedulable": True}}
        if reason:
            at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            body["metadata"] = {"annotations": {CORDON_REASON: " ".join(reason.split())[:1000],
                                                CORDONED_BY: by or "sftctl", CORDONED_AT: at}}
        return self._json(f"cordon node {node_name}", self._core().patch_node, node_name, body, allow=(404,))

    @classmethod
    def for_job(cls, spec, channel, secrets) -> "KubernetesProvider":
        """The job's provider (:class:`~sftctl.providers.base.BuiltForJob`): with job storage,
        its channel, the values the job's Secret carries and the world size its pods learn."""
        ch = channel()
        if ch is None:
            return cls()
        return cls(channel=ch, secrets=secrets(), num_nodes=spec.resources.nodes)

    @classmethod
    def node_objects(cls, request: InstanceRequest, *, provider: "KubernetesProvider | None" = None,
                     secret_names: Sequence[str] = (), num_nodes: int | None = None) -> tuple[str, list[dict]]:
        """``("Kubernetes objects", objects)``: what :meth:`create_instance` makes for ``request`` (ConfigMap, Service, Secret
        with every value ``<secret>``, pod), as ``run --dry-run`` and the launch request show
        them (:class:`~sftctl.providers.base.RendersNodeDocuments`): with the controller's
        ``provider``, its namespace, image, world size, Secret's names and machines kept out;
        else this configuration's namespace (:func:`preview_namespace`), the default image,
        ``num_nodes`` and ``secret_names``."""
        if provider is not None:
            names, avoid = sorted(provider.secrets), sorted(provider.avoid_hosts.get(request.job_id, ()))
            namespace, image, num_nodes = provider.namespace, provider.image, provider.num_nodes
        else:
            names, avoid, namespace, image = list(secret_names), [], preview_namespace(), None
        objs = node_manifests(request, namespace=namespace, secrets={k: "<secret>" for k in names} or None,
                              image=image, num_nodes=num_nodes, avoid_hosts=avoid)
        return "Kubernetes objects", [o for o in objs.values() if o is not None]

    def keep_out(self, job_id: str, machines: set[str]) -> set[str]:
        """Give ``job_id``'s next pods node anti-affinity to ``machines`` (hostnames the state
        marks bad); returns those not avoided yet."""
        avoid = self.avoid_hosts.setdefault(job_id, set())
        new = set(machines) - avoid
        avoid |= set(machines)
        return new

    def quarantine(self, handle: KubernetesHandle, reason: str) -> dict | None:
        """Keep the machine ``handle``'s pod ran on away from the job (called before
        :meth:`terminate` when a health verdict replaces the node; ``reason`` is the verdict).

        Always: the job's next pods get node anti-affinity to its ``kubernetes.io/hostname``
        (see :func:`node_manifests`). When the user may patch nodes: the node is cordoned with the
        verdict as :data:`CORDON_REASON` (:meth:`cordon`), so no one's pods land on it until an
        admin uncordons it. A 403 (RBAC without ``patch nodes``, usual on a shared cluster) or any
        other API error leaves the anti-affinity alone and is said in ``message``.

        Returns:
            ``{"machine": node name, "hostname": label value, "actions": ["anti-affinity",
            "cordon"?], "cordon_error": one line (when cordoning failed), "message": one line}``,
            or None when the pod was never scheduled (no machine to avoid). Raises nothing for
            API errors.
        """
        node = handle.node_name
        if not node:
            return None
        who = f"sftctl job {handle.job_id or '?'}, node {handle.node_id or '?'}"
        error = None
        try:
            obj = self.cordon(node, reason=reason, by=who)
        except (CredentialsError, ProviderError) as e:
            error, obj = e.message, self._read_node(node)
        gone = obj is None and error is None
        host = (((obj or {}).get("metadata") or {}).get("labels") or {}).get(HOSTNAME_LABEL) or node
        with self._lock:
            self.avoid_hosts.setdefault(handle.job_id or "", set()).add(host)
        avoid = f"this job's next pods avoid it ({HOSTNAME_LABEL} NotIn {host})"
        if error is not None:
            message = (f"kubernetes: could not cordon node {node} ({error}); {avoid}; a cluster admin can "
                       f"`kubectl cordon {node}`")
        elif gone:
            message = f"kubernetes: node {node} is gone; {avoid}"
        else:
            message = f"kubernetes: cordoned node {node} ({CORDON_REASON}: {reason}); {avoid}"
        out = {"machine": node, "hostname": host, "actions": ["anti-affinity"] + ([] if error or gone else ["cordon"]),
               "message": message}
        if error is not None:
            out["cordon_error"] = error
        return out

    def _read_node(self, name: str) -> dict | None:
        """The node as the API's JSON, or None when it is gone or the user may not read it."""
        try:
            return self._json(f"read node {name}", self._core().read_node, name, allow=(403, 404))
        except (CredentialsError, ProviderError):
            return None


# -------------------------------------------------------------------- pod status


def _ready(node: dict) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions) or not conditions


def _pod_state(pod: dict | None) -> InstanceState:
    if pod is None:
        return InstanceState.GONE
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return InstanceState.STOPPING
    phase = (pod.get("status") or {}).get("phase")
    if phase == "Running":
        return InstanceState.RUNNING
    if phase in ("Succeeded", "Failed", "Unknown"):
        return InstanceState.STOPPING
    return InstanceState.PENDING


def _unschedulable(pod: dict) -> str | None:
    """The scheduler's message when the pod's PodScheduled condition is False, else None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return " ".join(str(c.get("message") or c.get("reason") or "Unschedulable").split())
    return None


def _fatal_wait(pod: dict) -> str | None:
    """A container waiting reason that no amount of waiting fixes (a bad image name, a missing
    ConfigMap or Secret), or None."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("InvalidImageName", "CreateContainerConfigError"):
            return f"{waiting['reason']}: {' '.join(str(waiting.get('message', '')).split())}".rstrip(": ")
    return None


def _pod_detail(pod: dict | None) -> str:
    if pod is None:
        return "the pod is gone"
    status = pod.get("status") or {}
    parts = [f"phase {status.get('phase', '?')}"]
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state:
            t = state["terminated"]
            parts.append(f"exit code {t.get('exitCode')} ({t.get('reason', '')})")
        elif "waiting" in state:
            parts.append(f"waiting: {state['waiting'].get('reason', '')}")
    message = _unschedulable(pod)
    if message:
        parts.append(message)
    return ", ".join(parts)


def preview_namespace() -> str:
    """The namespace the Kubernetes provider would use here (``SFTCTL_K8S_NAMESPACE``, else the
    kubeconfig context's, else ``default``); without a usable kubeconfig, the setting or ``default``
    (a dry run still shows the objects)."""
    try:
        return KubernetesProvider().namespace
    except (SftctlError, ImportError):  # no kubeconfig, or no SDK, on this machine
        return settings.get("SFTCTL_K8S_NAMESPACE") or "default"
