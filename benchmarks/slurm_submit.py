"""Slurm: submit-to-running of `sftctl run` against Slurm's own `sbatch` + `srun`, and `sftctl
status` latency with Slurm jobs in the state.

Runs a real 2-node Slurm cluster on this machine (tests/slurm_cluster.py: munged, slurmctld, one
slurmd per node; needs root and Debian's slurm-wlm + munge). Measured side by side, alternating:

* ``sbatch + srun``: ``sbatch`` of a 2-node allocation (one task per node) whose script runs
  ``srun`` writing a timestamp on each node; time from the sbatch call until both timestamps
  exist.
* ``sftctl run --detach``: the same allocation through sftctl (plan with ``sinfo`` and
  ``sbatch --test-only``, a detached controller, sbatch from the template, srun, each node's
  script); time from the CLI call until both nodes' run commands have written their timestamp.
* ``sftctl status`` (table and ``--json``) with ``--jobs`` finished Slurm jobs plus one running,
  next to ``python -c "import sftctl.cli"`` timed in the same run (the machine's load shows there;
  ``status`` itself calls no Slurm command, so Slurm jobs cost it what any job costs).

* Node failure on a 3-node cluster, 2-node job: the node of rank 1 dies (its slurmd and job
  steps SIGKILLed); seconds until Slurm marks it down and until rank 1 runs again on another
  node from its checkpoint, with Slurm's requeue (default) and with ``slurm.requeue: false``
  (sftctl replaces the node and excludes it).

Prints a table and writes benchmarks/results/slurm_submit.json.

    python benchmarks/slurm_submit.py [--repeat 5] [--jobs 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
RESULTS = REPO / "benchmarks" / "results" / "slurm_submit.json"

from cli_latency import timed  # noqa: E402  (benchmarks/ is on sys.path: this runs as a script)

SPEC = """\
name: bench-slurm
workdir: {work}
resources: {{accelerators: ["cpu:1"], nodes: 2, clouds: [slurm]}}
health: {{enabled: false}}
run: |
  date +%s.%N > {work}/{tag}-$SFTCTL_NODE_RANK
  {tail}
"""


def wait_files(paths: list[Path], timeout_s: float = 120) -> float:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(p.exists() and p.stat().st_size for p in paths):
            return max(float(p.read_text()) for p in paths)
        time.sleep(0.005)
    raise SystemExit(f"timed out waiting for {paths}")


def squeue_empty(env: dict, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=env).stdout.strip():
            return
        time.sleep(0.1)
    raise SystemExit("squeue did not empty")


def sbatch_srun(work: Path, i: int, env: dict) -> float:
    tag = f"native{i}"
    script = work / f"{tag}.sh"
    script.write_text(f"#!/bin/bash\nsrun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
                      f"bash -c 'date +%s.%N > {work}/{tag}-$SLURM_NODEID'\n")
    t0 = time.time()
    subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                    f"--output={work}/{tag}.out", str(script)], check=True, capture_output=True, env=env)
    done = wait_files([work / f"{tag}-0", work / f"{tag}-1"])
    squeue_empty(env)
    return done - t0


def sftctl_run(work: Path, i: int, env: dict) -> float:
    tag = f"sftctl{i}"
    spec = work / f"{tag}.yaml"
    spec.write_text(SPEC.format(work=work, tag=tag, tail="true"))
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "sftctl.cli", "run", str(spec), "--detach", "--json"], check=True,
                   capture_output=True, env=env)
    done = wait_files([work / f"{tag}-0", work / f"{tag}-1"])
    squeue_empty(env)
    return done - t0


LOOP = """\
name: bench-recovery
workdir: {work}
resources: {{accelerators: ["cpu:1"], nodes: 2, clouds: [slurm]}}
health: {{enabled: false}}
recovery: {{max_restarts: 1}}
slurm: {{requeue: {requeue}}}
run: |
  date +%s.%N >> {work}/runs-$SFTCTL_NODE_RANK
  ckpt={work}/ckpt-$SFTCTL_NODE_RANK
  start=$(cat $ckpt 2>/dev/null || echo 0)
  for i in $(seq $start 40); do echo $i > $ckpt.tmp && mv $ckpt.tmp $ckpt; sleep 0.3; done
"""


def recovery(tmp: Path, requeue: bool) -> dict:
    """Seconds from a node's death (slurmd and its steps SIGKILLed) to Slurm marking it down and
    to the training running again on the remaining nodes from its checkpoint."""
    from slurm_cluster import SlurmCluster

    work = tmp / f"recovery-{requeue}"
    work.mkdir()
    with SlurmCluster(tmp / f"cluster-{requeue}", nodes=3) as cluster:
        env = {**os.environ, **cluster.env(), "SFTCTL_HOME": str(tmp / f"home-{requeue}"), "PYTHONPATH": str(REPO)}
        spec = work / "loop.yaml"
        spec.write_text(LOOP.format(work=work, requeue=str(requeue).lower()))
        job = json.loads(subprocess.run([sys.executable, "-m", "sftctl.cli", "run", str(spec), "--detach", "--json"],
                                        check=True, capture_output=True, env=env).stdout)["job_id"]
        ckpt = work / "ckpt-1"
        end = time.monotonic() + 120
        while time.monotonic() < end and not (ckpt.exists() and ckpt.read_text().strip() not in ("", "0", "1", "2")):
            time.sleep(0.05)
        host = (tmp / f"home-{requeue}" / "jobs" / job / "slurm" / "nodes").glob("*-n1-*/host-1")
        victim = next(host).read_text().strip()
        killed_at_step = int(ckpt.read_text())
        t_kill = time.time()
        cluster.kill_node(victim)
        t_down = None
        runs = work / "runs-1"
        while time.time() - t_kill < 180:
            if t_down is None and "down" in subprocess.run(["sinfo", "-h", "-N", "-n", victim, "-o", "%t"],
                                                           capture_output=True, text=True, env=env).stdout:
                t_down = time.time()
            if len(runs.read_text().split()) >= 2:
                break
            time.sleep(0.1)
        t_resumed = float(runs.read_text().split()[1])
        resumed_step = int(ckpt.read_text())
        while time.time() - t_kill < 240:
            doc = json.loads(subprocess.run([sys.executable, "-m", "sftctl.cli", "status", job, "--json"],
                                            capture_output=True, env=env).stdout)
            if doc["status"] in ("SUCCEEDED", "FAILED", "FAILED_CONTROLLER", "CANCELLED"):
                break
            time.sleep(0.5)
        squeue_empty(env)
    return {"requeue": requeue, "status": doc["status"], "restarts": doc["restarts"],
            "killed_at_step": killed_at_step, "resumed_from_step": resumed_step,
            "kill_to_node_down_s": None if t_down is None else t_down - t_kill,
            "kill_to_resumed_s": t_resumed - t_kill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=20, help="finished Slurm jobs in the state for the status timing")
    args = ap.parse_args()

    from slurm_cluster import SlurmCluster, skip_reason

    why = skip_reason()
    if why:
        raise SystemExit(why)
    with tempfile.TemporaryDirectory(prefix="sftctl-bench-slurm-") as tmp:
        tmp = Path(tmp)
        work = tmp / "work"
        work.mkdir()
        with SlurmCluster(tmp / "cluster", nodes=2) as cluster:
            env = {**os.environ, **cluster.env(), "SFTCTL_HOME": str(tmp / "home"), "PYTHONPATH": str(REPO)}
            version = subprocess.run(["sinfo", "-V"], capture_output=True, text=True, env=env).stdout.strip()
            native, ours = [], []
            sftctl_run(work, 999, env)  # warm the page cache and the compile caches once
            for i in range(args.repeat):
                native.append(sbatch_srun(work, i, env))
                ours.append(sftctl_run(work, i, env))
            # the state: finished Slurm jobs (the runs above plus more), and one running
            for i in range(len(ours) + 1, args.jobs):
                sftctl_run(work, 100 + i, env)
            spec = work / "running.yaml"
            spec.write_text(SPEC.format(work=work, tag="running", tail="sleep 300"))
            job = json.loads(subprocess.run([sys.executable, "-m", "sftctl.cli", "run", str(spec), "--detach", "--json"],
                                            check=True, capture_output=True, env=env).stdout)["job_id"]
            wait_files([work / "running-0", work / "running-1"])
            n_jobs = len(json.loads(subprocess.run([sys.executable, "-m", "sftctl.cli", "status", "--json"],
                                                   check=True, capture_output=True, env=env).stdout)["jobs"])
            status_json = timed([sys.executable, "-m", "sftctl.cli", "status", "--json"], 2 * args.repeat, env)
            status_table = timed([sys.executable, "-m", "sftctl.cli", "status"], 2 * args.repeat, env)
            status_one = timed([sys.executable, "-m", "sftctl.cli", "status", job], 2 * args.repeat, env)
            floor = timed([sys.executable, "-c", "import sftctl.cli"], 2 * args.repeat, env)  # this machine's load
            subprocess.run([sys.executable, "-m", "sftctl.cli", "down", job], check=True, capture_output=True, env=env)
            squeue_empty(env)
        recoveries = [recovery(tmp, True), recovery(tmp, False)]
    med = {
        "sbatch + srun: submit to both nodes running": statistics.median(native),
        "sftctl run --detach: submit to both nodes running": statistics.median(ours),
        f"sftctl status --json ({n_jobs} Slurm jobs, 1 running)": statistics.median(status_json),
        f"sftctl status ({n_jobs} Slurm jobs, table)": statistics.median(status_table),
        "sftctl status JOB (the running Slurm job)": statistics.median(status_one),
        "import sftctl.cli (the floor, same run)": statistics.median(floor),
    }
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "slurm": version,
        "repeat": args.repeat,
        "samples_s": {"sbatch + srun": native, "sftctl run --detach": ours},
        "median_s": med,
        "sftctl_overhead_s": statistics.median(ours) - statistics.median(native),
        "node_failure": recoveries,
        "cluster_timeouts": "SlurmdTimeout=6, cred_expire=5 (requeue delay), sched_interval=2 (tests/slurm_cluster.py)",
        "aims_s": {"overhead over sbatch + srun": 2.0, "status": 0.3},
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    width = max(map(len, med))
    for k, v in med.items():
        print(f"{k:<{width}}  {v:7.3f} s")
    print(f"{'sftctl overhead over sbatch + srun':<{width}}  {doc['sftctl_overhead_s']:7.3f} s (aim: < 2 s)")
    for r in recoveries:
        how = "Slurm requeue" if r["requeue"] else "sftctl replace + --exclude"
        print(f"node killed at step {r['killed_at_step']} ({how}): node down after {r['kill_to_node_down_s']:.1f} s, "
              f"training again after {r['kill_to_resumed_s']:.1f} s from step {r['resumed_from_step']}; "
              f"{r['status']}, {r['restarts']} sftctl restart(s)")


if __name__ == "__main__":
    main()
