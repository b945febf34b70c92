"""Cloud TPU slices through the GCP provider: the real google-cloud-tpu client (REST) against the
TPU emulator (tests/tpu_emulator.py: the API's REST paths, every body parsed strictly into the
tpu_v2 message types), a real directory job storage for the per-worker launches, and real JAX
processes initialising jax.distributed with the environment the provider gives each host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gce_emulator import GCEEmulator
from tpu_emulator import TPUEmulator

from sftctl.catalog import cloud_offerings
from sftctl.errors import CapacityError
from sftctl.providers import gcp_tpu
from sftctl.providers.base import NodeState
from sftctl.providers.cloud import InstanceState, labels
from sftctl.providers.gcp import GCPProvider, instance_name
from sftctl.storage import open_storage
from sftctl.storage.stream import NodeChannel

BOOT = "#!/usr/bin/env bash\nexport SFTCTL_JOB_ID=j\nexport SFTCTL_NODE_ID=n0\necho booted $SFTCTL_NODE_ID\n"


@pytest.fixture(scope="module")
def emulators():
    with GCEEmulator() as gce, TPUEmulator() as tpu:
        yield gce, tpu


@pytest.fixture
def tpu(emulators):
    emulators[1].reset()
    yield emulators[1]
    emulators[1].reset()


def provider(emulators, channel=None) -> GCPProvider:
    from google.auth.credentials import AnonymousCredentials

    gce, tpu = emulators
    return GCPProvider(project=tpu.project, credentials=AnonymousCredentials(), api_endpoint=gce.url,
                       tpu_endpoint=tpu.url, poll_s=0.01, ready_timeout_s=30, channel=channel)


def offering(accelerator: str, chips: int, region: str):
    """The catalog's TPU offering of ``chips`` chips of ``accelerator`` in ``region``."""
    found = [o for o in cloud_offerings() if o.accelerator == accelerator and o.count == chips and o.region == region]
    assert len(found) == 1, (accelerator, chips, region, found)
    return found[0]


def test_slice_shapes_follow_googles_naming():
    assert gcp_tpu.slice_shape("v5litepod-8") == ("v5litepod", 8, 1)
    assert gcp_tpu.slice_shape("v5litepod-16") == ("v5litepod", 16, 4)
    assert gcp_tpu.slice_shape("v5p-8") == ("v5p", 4, 1)  # v5p names count TensorCores, 2 a chip
    assert gcp_tpu.slice_shape("v5p-16") == ("v5p", 8, 2)
    assert gcp_tpu.slice_shape("v6e-16") == ("v6e", 16, 4)
    assert gcp_tpu.slice_shape("a3-highgpu-8g") is None and not gcp_tpu.is_tpu("n1-standard-4+T4")
    assert gcp_tpu.worker_node_ids("job-n0", 3) == ["job-n0", "job-n0.w1", "job-n0.w2"]


def test_multi_host_slice_is_queued_launched_on_every_host_and_deleted(emulators, tpu, tmp_path):
    channel = NodeChannel(open_storage(str(tmp_path / "store")))
    p = provider(emulators, channel)
    o = offering("TPU-v5e", 16, "us-central1")
    assert o.instance_type == "v5litepod-16" and o.provider == "gcp"
    h = p.provision("job-tpu1", "job-tpu1-n0", 0, o, bootstrap=BOOT)
    assert h.id == instance_name("job-tpu1-n0") and h.zone == "us-central1-a" and h.instance_type == "v5litepod-16"
    assert h.ip == "10.130.0.2"  # worker 0's internal address: the coordinator
    create = next(r for r in tpu.requests if r["method"] == "POST")
    assert create["query"]["queuedResourceId"] == h.id and "spot" not in create["body"]
    spec = create["body"]["tpu"]["nodeSpec"][0]
    assert spec["parent"] == f"projects/{tpu.project}/locations/us-central1-a"
    node = spec["node"]
    assert node["acceleratorType"] == "v5litepod-16" and node["runtimeVersion"] == "v2-alpha-tpuv5-lite"
    assert node["labels"] == labels("job-tpu1", "job-tpu1-n0")
    script = node["metadata"]["startup-script"]
    assert script.index("export SFTCTL_NODE_ID=n0") < script.index("agent-worker-number") < script.index("echo booted")
    # the wrapped bootstrap: worker 2 is node n0.w2, worker 0 stays n0 (run it for real)
    for w, want in ((0, "booted n0"), (2, "booted n0.w2")):
        out = subprocess.run(["bash", "-c", script], env={**os.environ, "SFTCTL_TPU_WORKER": str(w)},
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == want, out
    assert p.describe(h) == InstanceState.RUNNING

    h = p.launch(h, "python train.py", {"A": "1"}, attempt=1)
    docs = {}
    for w, node_id in enumerate(gcp_tpu.worker_node_ids("job-tpu1-n0", 4)):
        docs[w] = json.loads(channel.storage.get_bytes(channel.launch_key(node_id, 1)))
    assert {w: d["env"]["JAX_PROCESS_ID"] for w, d in docs.items()} == {0: "0", 1: "1", 2: "2", 3: "3"}
    assert all(d["env"]["JAX_COORDINATOR_ADDRESS"] == "10.130.0.2:8476" and d["env"]["JAX_NUM_PROCESSES"] == "4"
               and d["env"]["A"] == "1" and d["script"] == "python train.py" for d in docs.values())
    for node_id in gcp_tpu.worker_node_ids("job-tpu1-n0", 4)[:3]:
        channel.storage.put_bytes(channel.ack_key(node_id, 1), b"")
    assert p.status(h).state == NodeState.RUNNING
    p.launch_timeout_s = 0.0  # worker 3's daemon never took the attempt: a lost host
    st = p.status(h)
    assert st.state == NodeState.LOST and "TPU worker 3" in st.detail
    channel.storage.put_bytes(channel.ack_key("job-tpu1-n0.w3", 1), b"")
    assert p.status(h).state == NodeState.RUNNING
    p.launch_timeout_s = 900.0
    for node_id in gcp_tpu.worker_node_ids("job-tpu1-n0", 4)[:3]:
        channel.storage.put_bytes(channel.exit_key(node_id, 1), b"0\n")
    assert p.status(h).state == NodeState.RUNNING  # worker 3 still runs
    channel.storage.put_bytes(channel.exit_key("job-tpu1-n0.w3", 1), b"0\n")
    assert p.status(h).state == NodeState.SUCCEEDED
    h2 = p.launch(h, "python train.py", {}, attempt=2)
    channel.storage.put_bytes(channel.exit_key("job-tpu1-n0.w2", 2), b"3\n")
    st = p.status(h2)
    assert st.state == NodeState.FAILED and st.exit_code == 3 and "worker 2" in st.detail

    listed = p.list_instances("job-tpu1")
    assert [(x["id"], x["instance_type"], x["node_id"]) for x in listed] == [(h.id, "v5litepod-16", "job-tpu1-n0")]
    p.terminate(h)
    assert tpu.live() == [] and p.describe(h) == InstanceState.GONE
    p.terminate(h)  # idempotent


def test_spot_slice_preempted_reads_lost(emulators, tpu):
    p = provider(emulators)
    h = p.provision("job-spot", "job-spot-n0", 0, offering("TPU-v6e", 8, "us-east5"), spot=True)
    body = next(r for r in tpu.requests if r["method"] == "POST")["body"]
    assert body["spot"] == {} and body["tpu"]["nodeSpec"][0]["node"]["runtimeVersion"] == "v2-alpha-tpuv6e"
    assert h.spot and p.status(h).state == NodeState.READY
    tpu.preempt(h.id)
    st = p.status(h)
    assert st.state == NodeState.LOST and "stopping" in st.detail
    p.terminate(h)
    assert tpu.live() == []


def test_a_lost_host_or_failed_tpu_runtime_replaces_the_slice(emulators, tpu):
    p = provider(emulators)
    h = p.provision("job-sick", "job-sick-n0", 0, offering("TPU-v5e", 16, "us-central1"))
    assert p.status(h).state == NodeState.READY
    tpu.unhealthy(h.id, "UNHEALTHY_MAINTENANCE")
    st = p.status(h)
    assert st.state == NodeState.LOST and "stopping" in st.detail  # the controller replaces it
    p.terminate(h)
    assert tpu.live() == []


def test_stockout_moves_to_the_next_zone_then_fails_over(emulators, tpu):
    p = provider(emulators)
    o = offering("TPU-v6e", 8, "us-east5")
    tpu.stockout("us-east5-b", "v6e-8")
    h = p.provision("job-so", "job-so-n0", 0, o)
    assert h.zone == "us-east5-c" and tpu.live() == [h.id]  # the FAILED one in -b was deleted
    p.terminate(h)
    tpu.stockout("us-east5-c")
    with pytest.raises(CapacityError) as e:
        provider(emulators).provision("job-so2", "job-so2-n0", 0, o)
    assert e.value.scope == "offering" and "us-east5-b (STOCKOUT)" in e.value.message
    assert tpu.live() == []


def test_the_emulator_rejects_what_the_api_rejects(emulators, tpu):
    url = f"{tpu.url}/v2/projects/{tpu.project}/locations/us-central1-a/queuedResources?queuedResourceId=x1"
    node = {"acceleratorType": "v5litepod-8", "runtimeVersion": "v2-alpha-tpuv5-lite"}
    good = {"tpu": {"nodeSpec": [{"parent": f"projects/{tpu.project}/locations/us-central1-a", "nodeId": "x1",
                                  "node": node}]}}
    r = requests.post(url, json={**good, "spotty": {}}, timeout=10)
    assert r.status_code == 400 and "spotty" in r.json()["error"]["message"]  # not in the schema
    r = requests.post(url, json={"tpu": {"nodeSpec": [{**good["tpu"]["nodeSpec"][0],
                                                       "node": {**node, "acceleratorType": "v6e-8"}}]}}, timeout=10)
    assert r.status_code == 400 and "not available in zone us-central1-a" in r.json()["error"]["message"]
    r = requests.post(url, json={**good, "spot": {}, "guaranteed": {}}, timeout=10)
    assert r.status_code == 400
    assert requests.post(url, json=good, timeout=10).status_code == 200


KILLED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from google.auth.credentials import AnonymousCredentials
    from sftctl.catalog import cloud_offerings
    from sftctl.providers.gcp import GCPProvider
    p = GCPProvider(project={project!r}, credentials=AnonymousCredentials(), api_endpoint={gce!r},
                    tpu_endpoint={tpu!r}, poll_s=0.01, ready_timeout_s=30)
    o = next(o for o in cloud_offerings() if o.instance_type == "v5p-16" and o.region == "us-east5")
    h = p.provision("job-k9", "job-k9-n0", 0, o)
    print("up", h.id, flush=True)
    time.sleep(600)
""")


def test_nothing_is_left_after_kill_9_of_the_controller(emulators, tpu):
    gce, _ = emulators
    code = KILLED.format(tests=str(Path(__file__).parent), project=tpu.project, gce=gce.url, tpu=tpu.url)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("up "), line
        assert len(tpu.nodes[("us-east5-a", line.split()[1])]["networkEndpoints"]) == 2  # v5p-16: 2 hosts
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert tpu.live() == [line.split()[1]]
    assert provider(emulators).terminate_tagged("job-k9") == 1  # what `sftctl down` does from the labels
    assert tpu.live() == []


JAX_HOST = textwrap.dedent("""
    import os, jax
    jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                               int(os.environ["JAX_PROCESS_ID"]), initialization_timeout=60)
    print(jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
    jax.distributed.shutdown()
""")


def test_every_host_initialises_jax_distributed_from_its_env(tmp_path):
    """Two processes (the two hosts of a v5p-16) get worker_env's variables and form one JAX
    runtime of two processes: jax.distributed is initialised on every host."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for w in range(2):
        env = {**os.environ, **gcp_tpu.worker_env(2, w, "127.0.0.1", 4), "JAX_PLATFORMS": "cpu"}
        env["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{port}"  # a free port here, 8476 on a TPU VM
        procs.append(subprocess.Popen([sys.executable, "-c", JAX_HOST], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(o[0].split()[:3] for o in outs) == [["0", "2", "2"], ["1", "2", "2"]]
    assert gcp_tpu.worker_env(2, 1, "10.0.0.2", 4)["JAX_COORDINATOR_ADDRESS"] == "10.0.0.2:8476"


E2E_JOB = textwrap.dedent("""
    import os, jax
    host = os.environ["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[0]  # worker 0, as the provider says
    jax.distributed.initialize(f"{host}:{os.environ['COORD_PORT']}", int(os.environ["JAX_NUM_PROCESSES"]),
                               int(os.environ["JAX_PROCESS_ID"]), initialization_timeout=120)
    print(f"jax host {jax.process_index()} of {jax.process_count()} via {os.environ['JAX_COORDINATOR_ADDRESS']}",
          flush=True)
    jax.distributed.shutdown()
""")


def test_sftctl_run_on_a_two_host_tpu_slice_runs_jax_on_every_host(home, tmp_path):
    """`sftctl run` end to end on a v5p-16 (8 chips, 2 hosts): planned on GCP, queued through the
    TPU API (emulated), both hosts boot the real bootstrap (tests/tpu_emulator.TPUNodeSimulator
    plays the TPU VMs), each host's daemon runs the JAX script with its own process id and one
    coordinator, jax.distributed forms one runtime of 2 processes, the job succeeds through the
    job's storage, and the slice is deleted."""
    import socket

    from conftest import sftctl
    from gce_emulator import GCEEmulator
    from tpu_emulator import TPUEmulator, TPUNodeSimulator

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tmp_path / "work"
    work.mkdir()
    (work / "jax_hosts.py").write_text(E2E_JOB)
    spec = tmp_path / "tpu.yaml"
    spec.write_text(textwrap.dedent(f"""\
        name: tpu-e2e
        workdir: {work}
        resources: {{accelerators: ["TPU-v5p:8"], clouds: [gcp]}}
        storage: {tmp_path / "store"}
        health: {{enabled: false}}
        env: {{JAX_PLATFORMS: cpu, COORD_PORT: "{port}"}}
        run: python jax_hosts.py
        """))
    with GCEEmulator() as gce, TPUEmulator(host_ip="127.0.0.1") as tpu:
        sim = TPUNodeSimulator(tpu, tmp_path / "vms")
        sim.start()
        env = {**os.environ, "SFTCTL_GCE_ENDPOINT": gce.url, "SFTCTL_TPU_ENDPOINT": tpu.url,
               "CLOUDSDK_CORE_PROJECT": tpu.project}
        try:
            proc = sftctl("run", str(spec), "--json", timeout=600, env=env)
        finally:
            sim.close()
        assert proc.returncode == 0, proc.stderr[-4000:]
        doc = json.loads(proc.stdout)
        assert doc["status"] == "SUCCEEDED", doc.get("failure_reason")
        assert len(sim.booted) == 1 and sim.booted[0][1] == 2  # one slice, two hosts booted
        assert tpu.live() == []  # the slice was deleted
        create = next(r for r in tpu.requests if r["method"] == "POST")
        assert create["body"]["tpu"]["nodeSpec"][0]["node"]["acceleratorType"] == "v5p-16"
    logs = sftctl("logs", doc["id"], check=True, env=env).stdout
    assert "jax host 0 of 2 via 127.0.0.1:8476" in logs, logs[-3000:]
    w1 = (tmp_path / "vms").rglob("node.log")
    assert any("jax host 1 of 2" in p.read_text() for p in w1)  # worker 1 ran it too, in its own daemon
