"""One verdict on a job's controller (issue 39: ``controller_alive(job)``, dispatched to the job's
placement): for each placement a live controller reads alive and a dead one (its process killed,
its Slurm job or Kubernetes Job gone) reads dead, through the one function; the state's reaper,
``start`` and the server's orphans read the same verdict."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import wait_for

from sftctl.controller.placements import controller_alive
from sftctl.state import LeaseKeeper, Liveness, Store


def _process() -> subprocess.Popen:
    """A stand-in controller: a live process of this machine (killed by the test)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _killed(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("place", [None, "server"])
def test_a_controller_of_this_machine_is_alive_while_its_process_runs(home, place):
    """local (the default) and server: judged by the recorded pid and its start time; a job
    just submitted (no pid yet) is unknown, not dead; a killed controller reads dead and is reaped."""
    from sftctl import procs

    store = Store()
    spec = {"name": "alive", "run": "true", **({"controller": {"place": place}} if place else {})}
    job_id = store.create_job("alive", spec)
    fresh = controller_alive(store.get_job(job_id), store)
    assert fresh.alive is None and fresh.by == "grace"
    proc = _process()
    try:
        store.update_job(job_id, controller_pid=proc.pid, controller_start_ticks=procs.start_ticks(proc.pid))
        verdict = controller_alive(store.get_job(job_id), store)
        assert verdict == Liveness(True, f"pid {proc.pid} runs on this machine", "pid", None, proc.pid,
                                   procs.start_ticks(proc.pid))
        assert store.reap_dead_controllers() == []
    finally:
        _killed(proc)
    dead = controller_alive(store.get_job(job_id), store)
    assert (dead.alive, dead.why, dead.pid) == (False, f"pid {proc.pid} is gone", None)
    assert store.reap_dead_controllers() == [job_id]
    assert store.get_job(job_id).status == "FAILED_CONTROLLER"


def test_a_lease_held_by_a_killed_process_of_this_host_is_dead_at_once(home):
    """A controller placed elsewhere (here a Slurm job on this host, as in the test cluster) is
    judged by the job's lease; one killed -9 leaves its lease unexpired, yet its holder is a
    process of this host that is gone: the verdict is dead and the reaper fails the job now, not
    when the lease expires (it waited out the whole lease before)."""
    store = Store()
    job_id = store.create_job("placed", {"name": "placed", "run": "true", "controller": {"place": "slurm"}})
    proc = _process()
    holder = LeaseKeeper.holder_of(proc.pid)
    assert store.acquire_lease(job_id, holder, 3600.0)
    store.update_job(job_id, controller_pid=proc.pid, controller_start_ticks=int(holder.rsplit(":", 1)[1]))
    try:
        live = controller_alive(store.get_job(job_id), store, scheduler=False)
        assert (live.alive, live.by, live.holder, live.pid) == (True, "lease", holder, proc.pid)
        assert store.reap_dead_controllers() == []
    finally:
        _killed(proc)
    dead = controller_alive(store.get_job(job_id), store, scheduler=False)
    assert (dead.alive, dead.why) == (False, f"its lease holder {holder} was a process of this host that is gone")
    assert store.lease(job_id)[0] == holder  # unexpired: nobody renews it
    assert store.reap_dead_controllers() == [job_id]


def test_an_expired_lease_whose_holder_still_runs_here_is_alive(home):
    """A state outage longer than the lease (90 s) stops the controller's renewals: when the
    state answers again, its lease has expired though the controller runs on and renews within
    seconds. A reaper polling in between failed the live job (FAILED_CONTROLLER); a holder that
    is a live process of this host (same pid and start time) now reads alive, and once it is
    killed the expired lease reads dead."""
    store = Store()
    job_id = store.create_job("outage", {"name": "outage", "run": "true", "controller": {"place": "slurm"}})
    proc = _process()
    holder = LeaseKeeper.holder_of(proc.pid)
    assert store.acquire_lease(job_id, holder, -30.0)  # expired 30 s ago by the database's clock
    store.update_job(job_id, controller_pid=proc.pid, controller_start_ticks=int(holder.rsplit(":", 1)[1]))
    assert store.lease(job_id) is None and store.lease_row(job_id)[0] == holder
    try:
        live = controller_alive(store.get_job(job_id), store, scheduler=False)
        assert (live.alive, live.by, live.holder, live.pid) == (True, "lease", holder, proc.pid)
        assert live.why.startswith("its lease expired ") and "still runs on this host" in live.why
        assert store.reap_dead_controllers() == []
        assert store.renew_lease(job_id, holder, 60.0) and store.lease(job_id)[0] == holder  # its keeper renews
        assert store.acquire_lease(job_id, holder, -30.0)
    finally:
        _killed(proc)
    dead = controller_alive(store.get_job(job_id), store, scheduler=False)
    assert (dead.alive, dead.why) == (False, f"its lease holder {holder} was a process of this host that is gone")
    assert store.reap_dead_controllers() == [job_id]


# ------------------------------------------------------------------ a scheduler's job


def test_a_controller_placed_on_slurm_is_alive_while_slurm_shows_its_job(cluster, home):
    """controller.place: slurm: the queued lease ``slurm:<id>`` reads alive while squeue shows the
    controller's Slurm job; once it is gone (an admin's scancel) the verdict is dead and the lease
    is given up; ``scheduler=False`` never asks Slurm and keeps the lease's word."""
    from sftctl.controller.placements import placement
    from sftctl.controller.placements.slurm import controller_provider
    from sftctl.paths import job_dir
    from sftctl.spec import JobSpec
    from sftctl.state import queued_holder

    store = Store()
    spec = {"name": "placed", "run": "true", "controller": {"place": "slurm"}}
    job_id = store.create_job("placed", spec)
    provider = controller_provider(JobSpec.model_validate(spec))
    jd = job_dir(job_id)
    jd.mkdir(parents=True, exist_ok=True)
    slurm_id = provider.submit_controller(job_id, ["sleep", "300"], partition=None, log=str(jd / "controller.log"),
                                          chdir=str(jd), env={"PATH": os.environ["PATH"]})
    try:
        assert store.acquire_lease(job_id, placement("slurm").holder(slurm_id), 3600.0)
        verdict = controller_alive(store.get_job(job_id), store)
        assert (verdict.alive, verdict.by, verdict.holder) == (True, "scheduler", queued_holder("slurm", slurm_id))
        assert verdict.why == f"queued as Slurm job {slurm_id}, which its scheduler still shows"
    finally:
        subprocess.run(["scancel", slurm_id], check=True)
    wait_for(lambda: slurm_id not in cluster.jobs(), timeout_s=30, what="the scancel")
    assert controller_alive(store.get_job(job_id), store, scheduler=False).alive is True  # the lease alone
    dead = controller_alive(store.get_job(job_id), store)
    assert (dead.alive, dead.by, dead.why) == (False, "scheduler", f"its Slurm job {slurm_id} left the queue without starting")
    assert store.lease(job_id) is None


def test_a_controller_placed_on_kubernetes_is_alive_while_its_job_exists(k8s, home):
    """controller.place: kubernetes: the queued lease ``kubernetes:<Job>`` reads alive while the
    API shows the controller's Job; deleted, the verdict is dead and the lease given up."""
    from sftctl.controller.placements import placement
    from sftctl.controller.placements.kubernetes import controller_provider

    store = Store()
    job_id = store.create_job("placed", {"name": "placed", "run": "true", "controller": {"place": "kubernetes"}})
    provider = controller_provider()
    name = provider.submit_controller(job_id, ["sleep", "300"], env={}, secret_env={})
    assert store.acquire_lease(job_id, placement("kubernetes").holder(name), 3600.0)
    verdict = controller_alive(store.get_job(job_id), store)
    assert (verdict.alive, verdict.by, verdict.holder) == (True, "scheduler", f"kubernetes:{name}")
    assert verdict.why == f"queued as Kubernetes Job {name}, which its scheduler still shows"
    assert provider.cancel_controller(job_id, 0) == [name]
    dead = controller_alive(store.get_job(job_id), store)
    assert (dead.alive, dead.why) == (False, f"its Kubernetes Job {name} left the queue without starting")
    assert store.lease(job_id) is None


@pytest.fixture
def k8s(tmp_path, monkeypatch):
    from k8s_emulator import K8sEmulator

    with K8sEmulator() as c:
        monkeypatch.setenv("KUBECONFIG", str(c.write_kubeconfig(tmp_path / "kubeconfig")))
        for var in ("SFTCTL_K8S_CONTEXT", "SFTCTL_K8S_NAMESPACE", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(var, raising=False)
        yield c


def _slurm_skip() -> str | None:
    from slurm_cluster import skip_reason

    return skip_reason()


@pytest.fixture
def cluster(tmp_path, monkeypatch, home):
    from slurm_cluster import SlurmCluster

    if _slurm_skip():
        pytest.skip(_slurm_skip() or "")
    with SlurmCluster(tmp_path / "slurm", nodes=1) as c:
        for k, v in c.env().items():
            monkeypatch.setenv(k, v)
        yield c
        end = time.monotonic() + 30
        while c.jobs() and time.monotonic() < end:
            time.sleep(0.5)
        assert c.jobs() == []
