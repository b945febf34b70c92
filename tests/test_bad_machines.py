"""Issue 41.3: the state remembers the machines a health verdict condemned, every later job keeps
them out (Slurm's ``--exclude`` of the next job's allocation), and the mark decays."""

from __future__ import annotations

from test_provider_slurm import cluster  # noqa: F401 (the real Slurm cluster fixture)

from sftctl.controller.preflight import keep_out, remember_machine
from sftctl.providers.slurm import SlurmProvider
from sftctl.state import Store
from sftctl.types import Offering


def test_a_verdict_marks_a_machine_counts_repeats_and_decays(state_backend):
    store = Store()
    store.mark_bad_machine("slurm", "node3", "preflight_slow", "CPU matmul at 12% of this machine's",
                           job_id="j1", now=1000.0, decay_s=3600.0)
    store.mark_bad_machine("slurm", "node3", "preflight_slow", "CPU matmul at 9% of this machine's",
                           job_id="j2", now=2000.0, decay_s=3600.0)
    store.mark_bad_machine("kubernetes", "gke-a-1", "xid", "XID 79: fell off the bus", zone="us-central1-a",
                           now=2500.0, decay_s=3600.0)
    [slurm] = store.bad_machines("slurm", now=3000.0)
    assert (slurm.machine, slurm.kind, slurm.count, slurm.job_id) == ("node3", "preflight_slow", 2, "j2")
    assert (slurm.first_at, slurm.at, slurm.until) == (1000.0, 2000.0, 5600.0)  # the repeat extends it
    assert slurm.evidence == "CPU matmul at 9% of this machine's"
    assert [m.machine for m in store.bad_machines(now=3000.0)] == ["gke-a-1", "node3"]  # newest verdict first
    assert store.bad_machines(now=5700.0) == [m for m in store.bad_machines(now=5700.0) if m.provider == "kubernetes"]
    assert [m.machine for m in store.bad_machines(now=6200.0)] == []  # both decayed: forgotten
    assert len(store.bad_machines(now=6200.0, include_decayed=True)) == 2  # still on record


def test_the_next_jobs_slurm_allocation_excludes_a_machine_a_verdict_condemned(home):
    store = Store()
    first = store.create_job("first", {"name": "first", "run": "true", "resources": {"nodes": 1}})
    # what SlurmProvider.quarantine answers for the node the verdict's attempt ran on
    done = {"machine": "node2", "actions": ["exclude"], "message": "slurm: node node2 is left out"}
    remember_machine(store, first, "slurm", None, done, "preflight_slow: start check: CPU matmul at 11% of ...")
    remember_machine(store, first, "local", None, None, "throttle: ...")  # a local node names no machine
    assert [(m.provider, m.machine, m.kind) for m in store.bad_machines()] == [("slurm", "node2", "preflight_slow")]
    # the line of a node whose own preflight ended its attempt names the kind after the exit
    remember_machine(store, first, "slurm", None, {**done, "machine": "node4"},
                     "node 1 exited with code 86: preflight_failed: start check: dcgmi diag -r 1 failed: PCIe")
    assert store.bad_machines()[0].kind == "preflight_failed"
    store.mark_bad_machine("slurm", "node4", "preflight_failed", "fixed", now=0.0, decay_s=1.0)  # decayed: out

    nxt = store.create_job("next", {"name": "next", "run": "true", "resources": {"nodes": 2}})
    provider = SlurmProvider(config={"partition": "debug"})
    offering = Offering(provider="slurm", instance_type="debug", accelerator="cpu", count=1, region="lab",
                        usd_per_hour=0.0)
    assert "--exclude" not in provider.batch_scripts(nxt, 1, ["a", "b"], offering)["sbatch.sh"]
    assert keep_out(store, provider, nxt) == ["node2"]
    assert "--exclude=node2" in provider.batch_scripts(nxt, 1, ["a", "b"], offering)["sbatch.sh"]
    assert keep_out(store, provider, nxt) == []  # said once
    [event] = [e for e in store.events(nxt) if e.kind == "machines"]
    assert event.message == "keeping out 1 machine(s) a verdict marked bad (sftctl nodes): node2 (preflight_slow)"


def test_sftctl_nodes_shows_the_marks_and_decayed_ones_only_with_all(home):
    import json
    import time

    from conftest import sftctl

    store = Store()
    store.mark_bad_machine("slurm", "node3", "preflight_slow", "CPU matmul at 12%", job_id="j1")
    store.mark_bad_machine("slurm", "node1", "xid", "XID 79", now=time.time() - 7200, decay_s=3600)  # decayed
    doc = json.loads(sftctl("nodes", "--json", check=True).stdout)
    assert [(m["provider"], m["machine"], m["kind"], m["count"]) for m in doc["machines"]] == [
        ("slurm", "node3", "preflight_slow", 1)]
    assert doc["machines"][0]["until"] - doc["machines"][0]["at"] == 72 * 3600  # SFTCTL_BAD_MACHINE_DECAY_H
    both = json.loads(sftctl("nodes", "--json", "--all", check=True).stdout)["machines"]
    assert sorted(m["machine"] for m in both) == ["node1", "node3"]
    table = sftctl("nodes", check=True).stdout
    assert "node3" in table and "preflight_slow" in table and "node1" not in table



def test_the_next_plan_on_slurm_leaves_the_marked_nodes_out(cluster, tmp_path):
    """A real 3-node cluster: two nodes marked bad leave one, so a 2-node job's plan gets Slurm's
    own refusal (``sbatch --test-only --exclude``), exit 3; once the marks decay it plans again."""
    import json

    from conftest import sftctl
    from test_provider_slurm import _gpu_plan_spec

    spec = _gpu_plan_spec(tmp_path)
    assert sftctl("plan", str(spec), "--json").returncode == 0
    store = Store()
    for name in cluster.names[:2]:
        store.mark_bad_machine("slurm", name, "preflight_slow", "GPU 0 matmul at 40% of predicted", decay_s=600)
    proc = sftctl("plan", str(spec))
    assert proc.returncode == 3 and "cannot run 2 node(s)" in proc.stderr, proc.stderr
    for name in cluster.names[:2]:  # decayed
        store.mark_bad_machine("slurm", name, "preflight_slow", "GPU 0 matmul at 40% of predicted", decay_s=-1)
    doc = json.loads(sftctl("plan", str(spec), "--json", check=True).stdout)
    assert [c["queue_wait_s"] for c in doc["candidates"] if c["provider"] == "slurm"] == [0.0]
