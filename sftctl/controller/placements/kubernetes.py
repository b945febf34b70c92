"""``controller.place: kubernetes``: the job's controller runs as a batch/v1 Job of its own on
the cluster (``sftctl-ctl-<job>``, :func:`sftctl.providers.kubernetes.controller_manifests`),
its state URL and the spec's secrets in the Job's Secret; see ARCHITECTURE.md, "Slurm" (the same
shape on Kubernetes)."""

from __future__ import annotations

import os
import types
from collections.abc import Mapping
from typing import Any

from sftctl import __version__, settings, vault
from sftctl.controller.placements.base import (
    SECRET, ControllerPlacement, Document, Placement, Render, controller_argv, forget_queued,
)
from sftctl.errors import SftctlError, SpecError
from sftctl.paths import sftctl_home
from sftctl.providers import get_provider
from sftctl.providers import kubernetes as k8s_provider
from sftctl.providers.kubernetes import DEFAULT_IMAGES, controller_manifests
from sftctl.providers.kubernetes.provider import preview_namespace
from sftctl.spec import JobSpec, env_references
from sftctl.state import QUEUED_CONTROLLER_LEASE_S, JobRecord, JobStatus, Store, is_url
from sftctl.types import FailureCode, capabilities

#: ``sh -c`` program of a controller Job whose image is the default (``python:3.11-slim``, no
#: sftctl): pip-install ``$0`` unless ``python`` already imports sftctl, then exec the argv
#: (``$@``). An image that has sftctl skips the install.
_INSTALL_THEN_EXEC = ('python -c "import sftctl" 2>/dev/null || pip install --quiet --no-cache-dir "$0" '
                      '|| { echo "sftctl: cannot pip install $0 in the controller pod" >&2; exit 1; }; exec "$@"')


def controller_provider(spec=None):
    """The Kubernetes provider that runs the controller: the configured context and namespace."""
    return get_provider("kubernetes")


def kubernetes_namespace() -> str:
    """The namespace the Kubernetes provider would use here (``SFTCTL_K8S_NAMESPACE``, else the
    kubeconfig context's, else ``default``); without a usable kubeconfig, the setting or ``default``
    (:func:`sftctl.providers.kubernetes.provider.preview_namespace`)."""
    return preview_namespace()


def controller_install() -> str:
    """What a controller Job on the default image pip-installs: ``SFTCTL_NODE_INSTALL`` when
    set (a lab's own index or wheel, as for cloud nodes), else this sftctl's version with the
    extras a controller uses (Postgres state, Kubernetes, the clouds)."""
    return settings.get("SFTCTL_NODE_INSTALL") or f"sftctl[aws,gcp,kubernetes,server]=={__version__}"


def controller_container_command(job_id: str, image: str | None) -> list[str]:
    """The container command of ``job_id``'s controller Job: :func:`controller_argv` with the
    image's ``python``; on the default image (``image`` None: python:3.11-slim, which has no
    sftctl) behind ``sh -c`` that first pip-installs :func:`controller_install` when sftctl is
    missing, as a cloud node's bootstrap does."""
    argv = controller_argv(job_id, "python")
    if image is not None:
        return argv
    return ["sh", "-c", _INSTALL_THEN_EXEC, controller_install(), *argv]


def controller_pod_env(spec: JobSpec, job_name: str, namespace: str,
                       environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """``(env, secret_env)`` of a controller's Kubernetes Job: plain values (the Job's name,
    ``SFTCTL_CONTROLLER_K8S_JOB``, and the namespace its Kubernetes nodes go to) and what the
    Secret carries (``SFTCTL_STATE_URL``, which holds the database password, and the values of
    the spec's ``secrets:`` from ``environ``, default this shell's environment; given the job's
    :func:`sftctl.vault.job_environ`, also the variables its ``env:`` refers to). Secrets travel by
    name: the state only ever records the spec."""
    names = set(spec.secrets)
    if environ is None:
        environ = os.environ
    else:  # the pod resolves env:'s references from its own environment too: the Secret's
        names |= {n for v in spec.env.values() for n in env_references(v) if n in environ}
    env = {"SFTCTL_CONTROLLER_K8S_JOB": job_name, "SFTCTL_K8S_NAMESPACE": namespace, "PYTHONUNBUFFERED": "1"}
    secret_env = {"SFTCTL_STATE_URL": settings.get("SFTCTL_STATE_URL"),
                  **{k: environ[k] for k in sorted(names) if k in environ}}
    return env, secret_env


def kubernetes_controller_args(spec: JobSpec, job_id: str, namespace: str,
                               environ: Mapping[str, str] | None = None) -> dict:
    """The keyword arguments (``argv``, ``env``, ``secret_env``, ``image``) of
    ``KubernetesProvider.submit_controller`` / ``controller_manifests`` for the controller of
    ``job_id`` in ``namespace``: what :meth:`KubernetesPlacement.place` creates and ``run --dry-run``
    shows (``image`` None: the provider's default; ``environ``: see :func:`controller_pod_env`)."""
    env, secret_env = controller_pod_env(spec, k8s_provider.controller_names(job_id)["job"], namespace, environ)
    return {"argv": controller_container_command(job_id, spec.controller.image), "env": env,
            "secret_env": secret_env, "image": spec.controller.image}


class KubernetesPlacement(Placement):
    """The controller as a Kubernetes Job; its lease is ``kubernetes:<Job>`` until it starts,
    taken over through ``SFTCTL_CONTROLLER_K8S_JOB``."""

    name = "kubernetes"
    elsewhere = True
    what = "Kubernetes Job"

    def check(self, spec, label: str, *, server: bool, provider: str | None) -> None:
        """A Postgres ``state.url`` (a pod never sees this machine's SQLite file); it cannot
        supervise nodes of this machine."""
        if provider is not None and capabilities(provider).local_admission:
            raise SpecError(f"{label}: controller.place: kubernetes cannot supervise local nodes (they run on this machine)",
                            hint="set resources.clouds to where the nodes should run (kubernetes, slurm, aws, gcp), "
                                 "or drop controller.place")
        state_url = settings.get("SFTCTL_STATE_URL")
        if not is_url(state_url):
            raise SpecError(
                f"{label}: controller.place: kubernetes: the job's state is this machine's SQLite file "
                f"({state_url or sftctl_home() / 'state.db'}), which a pod on the cluster cannot reach",
                hint="set state.url (SFTCTL_STATE_URL) to a Postgres database the cluster reaches, "
                     "or drop controller.place")

    def render(self, spec, job_id: str, where) -> ControllerPlacement:
        """The Job and its Secret (values ``<secret>``) in ``where.namespace`` (default:
        :func:`kubernetes_namespace`), and ``submit_controller``'s arguments."""
        import yaml

        ns = where.namespace or kubernetes_namespace()
        args = kubernetes_controller_args(spec, job_id, ns, where.environ)
        args["secret_env"] = {k: SECRET for k in args["secret_env"]}
        args["namespace"] = ns
        objs = controller_manifests(job_id, args["argv"], namespace=ns, env=args["env"],
                                    secret_env=args["secret_env"], image=args["image"] or DEFAULT_IMAGES["cpu"])
        return ControllerPlacement(self.name, types.MappingProxyType(args), (Document(
            "controller: Kubernetes objects",
            yaml.safe_dump_all([o for o in (objs["job"], objs["secret"]) if o is not None], sort_keys=False)),))

    def place(self, store: Store, job: JobRecord, spec, render: Render) -> str:
        """Create the Job (``python -m sftctl.queue JOB`` with the image's ``python``), its
        Secret's values filled from the job's owner's store (a server's job) or this environment.
        Raises ProviderError, CredentialsError: the API server refused it (exit 4; the job is FAILED)."""
        provider: Any = controller_provider(spec)
        try:
            ns = provider.namespace
            environ = vault.job_environ(store, job) if job.secrets_from == "store" else None  # the owner's
            args = dict(render(environ=environ, namespace=ns).args)
            args.pop("namespace")
            values = controller_pod_env(spec, args["env"]["SFTCTL_CONTROLLER_K8S_JOB"], ns, environ)[1]
            args["secret_env"] = {k: values[k] for k in args["secret_env"]}  # the names admitted, their values now
            name = provider.submit_controller(job.id, **args)
        except SftctlError as e:
            store.transition(job.id, JobStatus.FAILED, f"its controller could not be placed on Kubernetes: {e.message}",
                             strict=False, code=FailureCode.PROVIDER_ERROR.value)
            raise
        store.acquire_lease(job.id, self.holder(name), QUEUED_CONTROLLER_LEASE_S)
        store.add_event(job.id, "controller", f"controller: Kubernetes Job {name} in namespace {ns}",
                        {"place": "kubernetes", "kubernetes_job": name, "namespace": ns})
        return name

    def cancel(self, job: JobRecord, grace_s: float) -> list[str]:
        """Delete the Job with ``grace_s`` for its pod, and its Secret with it."""
        return controller_provider().cancel_controller(job.id, grace_s)

    def orphans(self, store: Store, job: JobRecord) -> str | None:
        """A controller Job gone before it started gives its ``kubernetes:<Job>`` lease up."""
        return forget_queued(store, job, self, controller_provider(),
                             "controller: Kubernetes Job {id} is gone without starting", "kubernetes_job")


PLACEMENT = KubernetesPlacement()
