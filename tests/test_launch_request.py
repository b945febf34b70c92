"""Issue 39.2: admission, then a launch request, then execution. ``run --dry-run`` and the launch
come from the same :class:`~sftctl.controller.launch.LaunchRequest`: what the controller hands
the real provider (each node's script and environment), what the provider writes or creates
(Slurm's sbatch.sh and step.sh, a node's Kubernetes objects) and what places the controller
(controller.sbatch.sh, its Kubernetes Job) equal, byte for byte, what the request renders the
way the dry run does (no provider instance, nothing created) for the same job, nodes and port;
the dry run's document is that request's with placeholders. Local, Slurm (tests/slurm_cluster.py)
and Kubernetes (tests/k8s_emulator.py, its kubeconfig context in namespace team-a: the dry run
used to show ``default`` there)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import yaml

from conftest import write_spec
from slurm_cluster import skip_reason
from test_provider_slurm import cluster  # noqa: F401 (the fixture)

SECRET_VALUE = "s3cr3t-value-39-2"


def _spec(tmp_path: Path, resources: str, extra: str = "") -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "train.sh").write_text("echo hi\n")
    return write_spec(tmp_path / "job.yaml", f"""\
name: launch-req
workdir: {work}
resources: {resources}
health: {{enabled: false}}
secrets: [SFTCTL_T_TOKEN]
env: {{PLAIN: "plain value", REF: "${{SFTCTL_T_REF:-fallback}}", API_TOKEN: "${{SFTCTL_T_TOKEN}}"}}
run: echo "rank=$SFTCTL_NODE_RANK"
{extra}""")


def _launch(spec: Path):
    """Dry-run ``spec``, submit it, and run its controller's provisioning and first launch in
    this process with the real provider, recording what the controller hands ``launch``.
    Returns ``(dry run document, controller, {rank: (script, env)})``."""
    from sftctl import api
    from sftctl.controller import Controller
    from sftctl.state import Store

    doc = api.dry_run(str(spec))
    job = api.submit(str(spec)).job_id
    ctrl = Controller(Store(), job)
    launched: dict[int, tuple[str, dict]] = {}
    real = ctrl.provider.launch

    def launch(handle, script, env, attempt):
        launched[handle.rank] = (script, dict(env))
        return real(handle, script, env, attempt)

    ctrl.provider.launch = launch
    ctrl._provision_on(ctrl.offering)
    ctrl._launch(1)
    return doc, ctrl, launched


def _as_dry_run_renders(ctrl, **where):
    """The request for ``ctrl``'s job, nodes, port and workdir pack, rendered as the dry run
    renders (no provider instance: a fresh one's documents)."""
    from sftctl.controller.launch import Where, admit

    return admit(ctrl.spec, ctrl.plan, Where.of(ctrl.job_id, ctrl.nodes, attempt=1, port=ctrl.rdzv_port,
                                                workdir_key=ctrl.workdir_key, **where))


def _check_nodes(doc: dict, ctrl, launched: dict) -> object:
    """Every node got its request's script and environment (values filled only at launch); the
    dry run's document is the same request's with placeholders."""
    from sftctl import vault
    from sftctl.controller.launch import Where, admit

    request = _as_dry_run_renders(ctrl)
    environ = vault.job_environ(ctrl.store, ctrl.store.get_job(ctrl.job_id))
    assert sorted(launched) == [n.rank for n in ctrl.nodes] == [n.rank for n in request.nodes]
    for node in request.nodes:
        script, env = launched[node.rank]
        assert script == node.script
        assert env == request.environment(node.rank, environ)
        assert (env["SFTCTL_T_TOKEN"], env["API_TOKEN"], env["REF"], env["PLAIN"]) == (
            SECRET_VALUE, SECRET_VALUE, "fallback", "plain value")
        assert (node.env["SFTCTL_T_TOKEN"], node.env["API_TOKEN"], node.env["REF"]) == (
            "<secret>", "${SFTCTL_T_TOKEN}", "${SFTCTL_T_REF:-fallback}")
        assert SECRET_VALUE not in repr(request)
    assert set(request.filled) == {"SFTCTL_T_TOKEN", "API_TOKEN", "REF"}
    preview = admit(ctrl.spec, ctrl.plan, Where(ranks=(0, 1))).preview()
    assert {k: doc[k] for k in preview} == preview
    assert doc["nodes"][0]["env"]["SFTCTL_JOB_ID"] == "<job-id>" and "SFTCTL_T_TOKEN" in doc["nodes"][0]["env"]
    return request


def _as_sent(created, sent):
    """``created`` (as the API server stores it) cut to the fields ``sent`` has: the server adds
    its own (uid, status, defaults such as a Service's clusterIPs), never changes what was sent."""
    if isinstance(sent, dict) and isinstance(created, dict):
        return {k: _as_sent(created[k], v) if k in created else "<missing>" for k, v in sent.items()}
    if isinstance(sent, list) and isinstance(created, list) and len(sent) == len(created):
        return [_as_sent(c, v) for c, v in zip(created, sent)]
    return created


def _same(created: dict, sent: dict) -> None:
    a, b = json.dumps(_as_sent(created, sent), sort_keys=True), json.dumps(sent, sort_keys=True)
    assert a == b, (sent["kind"], a, b)


def _secret_keys(obj: dict) -> dict:
    """A Secret with its values out of the comparison (the request holds names only)."""
    return {**obj, "data": sorted(obj.get("data") or {})}


def test_local_launch_is_the_dry_runs_request(tmp_path, home, monkeypatch):
    from sftctl.providers.base import terminate_all

    monkeypatch.setenv("SFTCTL_T_TOKEN", SECRET_VALUE)
    monkeypatch.delenv("SFTCTL_T_REF", raising=False)
    doc, ctrl, launched = _launch(_spec(tmp_path, "{nodes: 2}"))
    try:
        request = _check_nodes(doc, ctrl, launched)
        assert request.documents == () and request.controller.place is None
        for n in ctrl.nodes:  # the script the node runs is the request's, byte for byte
            assert Path(n.handle.dir, "node-1.sh").read_text() == request.node(n.rank).script
    finally:
        terminate_all(ctrl.provider, [n.handle for n in ctrl.nodes if n.handle is not None])


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_slurm_launch_and_placed_controller_are_the_dry_runs_request(cluster, tmp_path, home, monkeypatch):
    from sftctl.controller.launch import place_controller
    from sftctl.controller.submit import stop_placed_controller
    from sftctl.providers.base import terminate_all
    from sftctl.state import Store

    monkeypatch.setenv("SFTCTL_T_TOKEN", SECRET_VALUE)
    monkeypatch.delenv("SFTCTL_T_REF", raising=False)
    spec = _spec(tmp_path, '{accelerators: ["cpu:1"], nodes: 2, clouds: [slurm], deadline: 2h}',
                 "slurm: {qos: normal}\n")
    doc, ctrl, launched = _launch(spec)
    try:
        request = _check_nodes(doc, ctrl, launched)
        root = Path(ctrl.provider.job_root(ctrl.job_id))
        assert [d.name for d in request.documents] == ["attempt-1/sbatch.sh", "attempt-1/step.sh"]
        for d in request.documents:  # what sbatch was handed
            assert (root / d.name).read_text() == d.text, d.name
        for n in ctrl.nodes:
            assert Path(n.handle.dir, "node-1.sh").read_text() == request.node(n.rank).script
        assert [s["name"] for s in doc["submits"]] == ["attempt-1/sbatch.sh", "attempt-1/step.sh"]
    finally:
        terminate_all(ctrl.provider, [n.handle for n in ctrl.nodes if n.handle is not None])

    # controller.place: slurm: what place_controller submits is the request's controller.sbatch.sh
    placed = write_spec(tmp_path / "placed.yaml", spec.read_text() + "controller: {place: slurm}\n")
    from sftctl import api
    from sftctl.controller.launch import Where, admit

    doc = api.dry_run(str(placed))
    assert [s["name"] for s in doc["submits"]] == ["controller.sbatch.sh", "attempt-1/sbatch.sh", "attempt-1/step.sh"]
    store = Store()
    job = store.get_job(api.submit(str(placed)).job_id)
    request = admit(api.load(placed), job.plan, Where(job_id=job.id))
    [ctl] = request.controller.documents
    place_controller(store, job)
    try:
        written = Path(ctrl.provider.job_root(job.id), "controller.sbatch.sh")
        assert written.read_text() == ctl.text and f"sftctl-ctl-{job.id}" in ctl.text
        assert doc["submits"][0]["text"] == admit(api.load(placed), job.plan, Where()).controller.documents[0].text
    finally:
        stop_placed_controller(job, 0)


@pytest.fixture
def k8s(tmp_path, monkeypatch):
    """The Kubernetes API emulator as this test's cluster; the kubeconfig's context names the
    namespace team-a (SFTCTL_K8S_NAMESPACE unset)."""
    from k8s_emulator import K8sEmulator

    with K8sEmulator() as c:
        monkeypatch.setenv("KUBECONFIG", str(c.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")))
        for var in ("SFTCTL_K8S_CONTEXT", "SFTCTL_K8S_NAMESPACE", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(var, raising=False)
        yield c


def test_kubernetes_launch_and_placed_controller_are_the_dry_runs_request(k8s, pg_url, tmp_path, home, monkeypatch):
    from sftctl import api
    from sftctl.controller.launch import Where, admit, place_controller
    from sftctl.controller.submit import stop_placed_controller
    from sftctl.providers.base import terminate_all
    from sftctl.state import Store

    monkeypatch.setenv("SFTCTL_T_TOKEN", SECRET_VALUE)
    monkeypatch.delenv("SFTCTL_T_REF", raising=False)
    spec = _spec(tmp_path, '{accelerators: ["H100:8"], nodes: 2, clouds: [kubernetes]}',
                 f"storage: {tmp_path / 'storage'}\n")
    doc, ctrl, launched = _launch(spec)
    try:
        request = _check_nodes(doc, ctrl, launched)
        for node in request.nodes:  # each node's objects as the provider created them
            [text] = [d.text for d in node.documents]
            sent = [o for o in yaml.safe_load_all(text)]
            assert {o["metadata"]["namespace"] for o in sent} == {"team-a"}
            for obj in sent:
                kind = {"Secret": "secrets", "Service": "services", "ConfigMap": "configmaps", "Pod": "pods"}[obj["kind"]]
                created = k8s.get(kind, "team-a", obj["metadata"]["name"])
                if obj["kind"] == "Secret":
                    assert base64.b64decode(created["data"]["SFTCTL_T_TOKEN"]).decode() == SECRET_VALUE
                    created, obj = _secret_keys(created), _secret_keys(obj)
                _same(created, obj)
            assert node.bootstrap and k8s.get("configmaps", "team-a", sent[2]["metadata"]["name"])["data"][
                "bootstrap.sh"] == node.bootstrap
        assert doc["submits"][0]["name"] == "node 0: Kubernetes objects" and "namespace: team-a" in doc["submits"][0]["text"]
    finally:
        terminate_all(ctrl.provider, [n.handle for n in ctrl.nodes if n.handle is not None])

    # controller.place: kubernetes: the Job and Secret place_controller creates are the request's
    placed = write_spec(tmp_path / "placed.yaml", spec.read_text() + "controller: {place: kubernetes}\n")
    doc = api.dry_run(str(placed))
    assert doc["submits"][0]["name"] == "controller: Kubernetes objects"
    store = Store()
    job = store.get_job(api.submit(str(placed)).job_id)
    request = admit(api.load(placed), job.plan, Where(job_id=job.id))
    [ctl] = request.controller.documents
    sent_job, sent_secret = yaml.safe_load_all(ctl.text)
    place_controller(store, job)
    try:
        _same(k8s.get("jobs", "team-a", sent_job["metadata"]["name"]), sent_job)
        secret = k8s.get("secrets", "team-a", sent_secret["metadata"]["name"])
        assert base64.b64decode(secret["data"]["SFTCTL_T_TOKEN"]).decode() == SECRET_VALUE
        _same(_secret_keys(secret), _secret_keys(sent_secret))
        assert SECRET_VALUE not in repr(request) and pg_url not in ctl.text
    finally:
        stop_placed_controller(job, 0)
