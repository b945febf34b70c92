"""``sftctl run --dry-run``: what a job would provision and start, rendered but not done.

Built from the same functions the controller uses (:func:`sftctl.controller.submit.node_env`,
the templates, the providers' script builders), with no store and no provider instance: nothing
is recorded, created or started."""

from __future__ import annotations

import difflib

from sftctl import settings
from sftctl.catalog import Offering
from sftctl.controller.slots import NodeSlot
from sftctl.controller.submit import (
    controller_job_args,
    controller_provider,
    default_install,
    job_storage_url,
    kubernetes_controller_args,
    node_env,
    required_secrets,
)
from sftctl.providers import get_provider
from sftctl.providers.cloud import InstanceRequest
from sftctl.providers.kubernetes import DEFAULT_IMAGES, controller_manifests, node_manifests
from sftctl.spec import JobSpec, env_references
from sftctl.storage.secrets import aws_ref
from sftctl.templates import render
from sftctl.types import NodeHandle, Plan, capabilities


def preview(spec: JobSpec, plan: Plan, job_id: str = "<job-id>") -> dict:
    """What ``sftctl run`` would provision and start, rendered but not done (``run --dry-run``).

    Returns ``{"offering", "nodes": [{"rank", "env", "script", "bootstrap"}], "other_nodes",
    "submits": [{"name", "text"}]}``: node 0 in full (its environment with secret values shown as
    ``<secret>``, its attempt script ``node.sh`` and, on a cloud, its first-boot script), the rest
    summarised, so the output stays the same size for 2 nodes or 10,000: ``other_nodes`` is None
    for one node, else ``{"count", "ranks": [first, last], "env_differs": [names],
    "script_lines_differ": n, "bootstrap_lines_differ": n}`` (what rank 1 has that node 0 has not:
    its rank, node id, address...); ``submits``: what the scheduler would be handed (Slurm's sbatch
    and step scripts, node 0's Kubernetes manifests). Nothing is recorded, created or started.
    """
    offering = plan.offering
    cloud = not capabilities(offering.provider).local_admission
    count = spec.resources.nodes
    nodes = [NodeSlot(f"{job_id}-n{r}", r, NodeHandle(job_id=job_id, node_id=f"{job_id}-n{r}", rank=r,
                                                    ip=f"<node {r} ip>" if cloud else "127.0.0.1"))
             for r in range(count)]
    workdir_key = "<workdir pack>" if spec.storage is not None else None
    shown = [_preview_node(spec, plan, job_id, nodes, n, workdir_key, cloud)
             for n in nodes[:2]]  # node 0 in full, node 1 for what differs
    if count == 1:
        return {"offering": offering.to_dict(), "nodes": shown, "other_nodes": None,
                "submits": _preview_submits(spec, offering, job_id, nodes, shown)}

    def changed(a: str | None, b: str | None) -> int:
        lines = difflib.ndiff((a or "").splitlines(), (b or "").splitlines())
        return sum(line.startswith("+ ") for line in lines)

    first, second = shown
    others = {"count": count - 1, "ranks": [1, count - 1],
              "env_differs": sorted(k for k in first["env"].keys() | second["env"].keys()
                                    if first["env"].get(k) != second["env"].get(k)),
              "script_lines_differ": changed(first["script"], second["script"]),
              "bootstrap_lines_differ": changed(first["bootstrap"], second["bootstrap"])}
    return {"offering": offering.to_dict(), "nodes": [first], "other_nodes": others,
            "submits": _preview_submits(spec, offering, job_id, nodes, [first])}


def _preview_node(spec: JobSpec, plan: Plan, job_id: str, nodes: list[NodeSlot], n: NodeSlot,
                  workdir_key: str | None, cloud: bool) -> dict:
    """One node of :func:`preview`: ``{"rank", "env", "script", "bootstrap"}``."""
    env = node_env(spec, job_id, plan, nodes, n.rank, 1, "<rendezvous port>", workdir_key)
    env.update({k: "<secret>" for k in spec.secrets if k in env})
    env.update({k: v for k, v in spec.env.items() if env_references(v)})  # ${MY_API_TOKEN}, not its value
    script = render("node.sh.j2", job_id=job_id, node_id=n.id, rank=n.rank, attempt=1,
                    workdir=spec.workdir, setup=spec.setup, run=spec.run, health=spec.health.enabled,
                    secrets=required_secrets(spec))
    bootstrap = None
    if cloud:
        ref = ""
        if plan.offering.provider == "aws" and required_secrets(spec):  # what secrets_ref will store
            ref = aws_ref(settings.get("SFTCTL_AWS_SECRETS_REGION"), job_id)
        bootstrap = render("bootstrap.sh.j2", job_id=job_id, node_id=n.id, rank=n.rank,
                           storage_url=job_storage_url(spec, job_id) or "", secrets_ref=ref,
                           controller_grace_s=settings.get("SFTCTL_CLOUD_CONTROLLER_GRACE_S"),
                           install=settings.get("SFTCTL_NODE_INSTALL") or default_install())
    return {"rank": n.rank, "env": env, "script": script, "bootstrap": bootstrap}


def _preview_submits(spec: JobSpec, offering: Offering, job_id: str, nodes: list[NodeSlot],
                     shown: list[dict]) -> list[dict]:
    """What ``preview`` adds per provider: ``[{"name", "text"}]``, the documents sftctl would hand
    the scheduler: Slurm's ``sbatch.sh`` and ``step.sh``, the shown nodes' Kubernetes manifests
    (Secret values shown as ``<secret>``), and first the controller's own submission when
    ``controller.place`` puts it on Slurm (``controller.sbatch.sh``) or Kubernetes (its Job and
    Secret). Empty for the others (their nodes get ``bootstrap``)."""
    out = []
    if spec.controller.place == "slurm":  # the controller's own Slurm job (controller.place)
        ctl = controller_provider(spec)
        out.append({"name": "controller.sbatch.sh",
                    "text": ctl.controller_script(job_id, **controller_job_args(spec, job_id, ctl))})
    elif spec.controller.place == "kubernetes":
        import yaml

        ns = settings.get("SFTCTL_K8S_NAMESPACE") or "default"
        args = kubernetes_controller_args(spec, job_id, ns)
        objs = controller_manifests(job_id, args["argv"], namespace=ns, env=args["env"],
                                    secret_env={k: "<secret>" for k in args["secret_env"]},
                                    image=args["image"] or DEFAULT_IMAGES["cpu"])
        out.append({"name": "controller: Kubernetes objects",
                    "text": yaml.safe_dump_all([o for o in (objs["job"], objs["secret"]) if o is not None],
                                               sort_keys=False)})
    return out + _preview_node_submits(spec, offering, job_id, nodes, shown)


def _preview_node_submits(spec: JobSpec, offering: Offering, job_id: str, nodes: list[NodeSlot],
                          shown: list[dict]) -> list[dict]:
    provider = offering.provider
    if provider == "slurm":
        slurm = get_provider("slurm", config=spec.slurm.model_dump() if spec.slurm else None,
                             num_nodes=spec.resources.nodes, time_limit_s=spec.resources.deadline_s)
        scripts = slurm.batch_scripts(job_id, 1, [n.id for n in nodes], offering)
        return [{"name": f"attempt-1/{name}", "text": text} for name, text in scripts.items()]
    if provider == "kubernetes":
        import yaml

        out = []
        secrets = {k: "<secret>" for k in required_secrets(spec)}
        for n, shown_node in zip(nodes, shown):
            request = InstanceRequest(job_id=job_id, node_id=n.id, rank=n.rank, offering=offering,
                                      zone=None, spot=spec.resources.spot, bootstrap=shown_node["bootstrap"] or "",
                                      image=spec.resources.image)
            objs = node_manifests(request, namespace=settings.get("SFTCTL_K8S_NAMESPACE") or "default",
                                  secrets=secrets or None, num_nodes=spec.resources.nodes)
            out.append({"name": f"node {n.rank}: Kubernetes objects",
                        "text": yaml.safe_dump_all([o for o in objs.values() if o is not None], sort_keys=False)})
        return out
    return []
