"""CLI latency: `sftctl status --json` (empty state, and 1,000 jobs) and importing the CLI.

Aim (issue 23 item 15): `sftctl status` within 0.15 s on a quiet machine. It skips typer's
parameter parsing (whose adapters import pydantic): `python -X importtime -m sftctl.cli status
--json` shows what is left.

Peers measured in the same run: a bare `python -c pass` (the interpreter's own floor) and, when
SkyPilot is installed (`--sky PATH/TO/sky`, or `sky` on PATH), `sky status` on an empty state.
Prints a table and writes benchmarks/results/cli_latency.json.

``--history STEPS`` (issue 36) measures instead whether the run history slows ``status``: the
same 1,000 finished jobs twice, once as above and once each with STEPS reported steps per rank
(``metric_steps``) and STEPS GPU samples per node (``gpu_samples``, one per GPU, 8 GPUs a node), timing
``sftctl status --json`` on the two states in turns; prints the ratio (history / none) and
writes benchmarks/results/status_history.json.

    python benchmarks/cli_latency.py [--jobs 1000] [--repeat 15] [--sky /path/to/sky]
    python benchmarks/cli_latency.py --history 300 [--jobs 1000] [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "cli_latency.json"


def populate(home: Path, n_jobs: int) -> None:
    """Fill a fresh state with ``n_jobs`` finished jobs, each with 2 nodes, metrics and events."""
    os.environ["SFTCTL_HOME"] = str(home)
    from sftctl.state import JobStatus, Store

    store = Store()
    spec = {"name": "bench", "resources": {"nodes": 2, "accelerators": [{"name": "cpu", "count": 1}]},
            "train": {"steps": 300}, "run": "true"}
    offering = {"offering": {"provider": "local", "accelerator": "cpu", "count": 1, "instance_type": "local",
                             "region": "local", "usd_per_hour": 0.0}, "reason": "bench"}
    for _ in range(n_jobs):
        job = store.create_job("bench", spec)
        store.update_job(job, provider="local", offering_json=offering)
        for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.SUCCEEDED):
            store.transition(job, s)
        for rank in range(2):
            store.add_node(job, rank, "local", status="TERMINATED")
        store.record_metrics(job, [{"rank": r, "step": 300, "loss": 2.2, "step_time_s": 0.2,
                                    "tokens_per_s": 10000.0} for r in range(2)])


def populate_history(home: Path, steps: int, gpus: int = 8) -> tuple[int, int]:
    """Give every job of the state at ``home`` ``steps`` reported steps per rank (2 ranks) and
    ``steps`` GPU samples per node (2 nodes, ``gpus`` each), one a second, ending an hour ago;
    written in bulk (as reports would leave them, already inside the caps). Returns the rows
    written (steps, GPU samples)."""
    os.environ["SFTCTL_HOME"] = str(home)
    from sftctl.state import Store

    store = Store()
    t0 = time.time() - 3600.0 - steps
    n_steps = n_gpu = 0
    for job in store.list_jobs():
        step_rows = [(job.id, r, i + 1, 2.2 + 1.0 / (i + 1), 0.2, 10000.0, 3e-4, None, t0 + i)
                     for r in range(2) for i in range(steps)]
        gpu_rows = [(job.id, n, g, t0 + i, 0.0, 1, 90.0, 95.0, 60000.0, 61000.0, 70.0, 72.0, 1980.0, 1980.0,
                     650.0, 690.0, 0, 0) for n in range(2) for g in range(gpus) for i in range(steps)]
        with store.write() as db:
            db.executemany("INSERT INTO metric_steps (job_id, rank, step, loss, step_time_s, tokens_per_s, lr,"
                           " checkpoint, ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", step_rows)
            db.executemany("INSERT INTO gpu_samples (job_id, node_rank, gpu, ts, span_s, n, util_pct_min,"
                           " util_pct_max, memory_mib_min, memory_mib_max, temp_c_min, temp_c_max,"
                           " sm_clock_mhz_min, sm_clock_mhz_max, power_w_min, power_w_max, xids, ecc)"
                           " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", gpu_rows)
        n_steps, n_gpu = n_steps + len(step_rows), n_gpu + len(gpu_rows)
    store.close()
    return n_steps, n_gpu


def history_main(args) -> None:
    """``--history``: ``status --json`` with and without run history, timed in turns."""
    results = RESULTS.parent / "status_history.json"
    plain, full = (Path(tempfile.mkdtemp(prefix=f"sftctl-bench-{k}-")) for k in ("plain", "history"))
    t0 = time.perf_counter()
    populate(plain, args.jobs)
    populate(full, args.jobs)
    rows = populate_history(full, args.history)
    populate_s = time.perf_counter() - t0
    sftctl = [sys.executable, "-m", "sftctl.cli", "status", "--json"]
    envs = {"none": {**os.environ, "SFTCTL_HOME": str(plain)}, "history": {**os.environ, "SFTCTL_HOME": str(full)}}
    for env in envs.values():  # warm the page cache; both list every job
        assert len(json.loads(subprocess.run(sftctl, capture_output=True, env=env, check=True).stdout)["jobs"]) == args.jobs
    times: dict[str, list[float]] = {k: [] for k in envs}
    for _ in range(args.repeat):  # in turns: a busy machine's load falls on both alike
        for k, env in envs.items():
            times[k] += timed(sftctl, 1, env)
    sizes = {k: sum(f.stat().st_size for f in (plain if k == "none" else full).glob("state.db*")) for k in envs}
    for home in (plain, full):
        shutil.rmtree(home, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["history"] / med["none"]
    print(f"\nsftctl status --json, {args.jobs} finished jobs, median of {args.repeat} runs in turns "
          f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}); states populated in {populate_s:.1f} s")
    print(f"{'state':48s} {'median s':>9s} {'min s':>7s} {'state.db MB':>12s}")
    print(f"{'no history':48s} {med['none']:9.3f} {min(times['none']):7.3f} {sizes['none'] / 1e6:12.1f}")
    label = f"{rows[0]:,} steps + {rows[1]:,} GPU samples"
    print(f"{label:48s} {med['history']:9.3f} {min(times['history']):7.3f} {sizes['history'] / 1e6:12.1f}")
    print(f"ratio (history / none): {ratio:.2f}x")
    results.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "jobs": args.jobs, "steps_per_rank": args.history, "step_rows": rows[0], "gpu_rows": rows[1],
        "repeat": args.repeat, "median_s": med, "min_s": {k: min(v) for k, v in times.items()},
        "ratio_history_over_none": ratio, "state_db_bytes": sizes, "load_average": os.getloadavg(),
    }, indent=2) + "\n")
    print(f"wrote {results}")


def timed(cmd: list[str], repeat: int, env: dict) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, env=env)
        out.append(time.perf_counter() - t0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.decode()[-2000:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--sky", default=shutil.which("sky"))
    ap.add_argument("--history", type=int, default=0, metavar="STEPS",
                    help="compare status with STEPS steps per rank and GPU samples per node of history (issue 36)")
    args = ap.parse_args()
    if args.history:
        return history_main(args)

    home = Path(tempfile.mkdtemp(prefix="sftctl-bench-"))
    t0 = time.perf_counter()
    populate(home, args.jobs)
    populate_s = time.perf_counter() - t0
    env = {**os.environ, "SFTCTL_HOME": str(home)}
    sftctl = [sys.executable, "-m", "sftctl.cli"]
    jobs_listed = len(json.loads(subprocess.run(sftctl + ["status", "--json"], capture_output=True, env=env).stdout)["jobs"])
    assert jobs_listed == args.jobs, jobs_listed

    empty = Path(tempfile.mkdtemp(prefix="sftctl-bench-empty-"))
    rows: dict[str, list[float]] = {
        "python -c pass": timed([sys.executable, "-c", "pass"], args.repeat, env),
        "sftctl status --json (empty state)": timed(sftctl + ["status", "--json"], args.repeat,
                                                    {**env, "SFTCTL_HOME": str(empty)}),
        "import sftctl.cli": timed([sys.executable, "-c", "import sftctl.cli"], args.repeat, env),
        f"sftctl status --json ({args.jobs} jobs)": timed(sftctl + ["status", "--json"], args.repeat, env),
        f"sftctl status ({args.jobs} jobs, table)": timed(sftctl + ["status"], args.repeat, env),
    }
    if args.sky:
        sky_env = {**env, "HOME": str(home / "skyhome")}
        (home / "skyhome").mkdir()
        # the first call starts SkyPilot's API server (cold); later calls reuse it (warm)
        rows["sky status (SkyPilot, cold)"] = timed([args.sky, "status"], 1, sky_env)
        rows["sky status (SkyPilot, warm)"] = timed([args.sky, "status"], max(3, args.repeat // 3), sky_env)
        subprocess.run([args.sky, "api", "stop"], capture_output=True, env=sky_env)
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(empty, ignore_errors=True)

    status_key = f"sftctl status --json ({args.jobs} jobs)"
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nCLI latency, median of {args.repeat} runs ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores); state populated in {populate_s:.1f} s")
    print(f"{'command':45s} {'median s':>9s} {'min s':>7s} {'vs sftctl status':>17s}")
    for k, v in rows.items():
        print(f"{k:45s} {med[k]:9.3f} {min(v):7.3f} {med[k] / med[status_key]:16.2f}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "jobs": args.jobs,
        "repeat": args.repeat,
        "median_s": med,
        "min_s": {k: min(v) for k, v in rows.items()},
        "aim_s": 0.15,
        "load_average": os.getloadavg(),
    }, indent=2) + "\n")
    print(f"\nwrote {RESULTS.relative_to(Path.cwd()) if RESULTS.is_relative_to(Path.cwd()) else RESULTS}")


if __name__ == "__main__":
    main()
