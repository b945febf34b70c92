"""CLI latency: `sftctl status --json` (empty state, and 1,000 jobs) and importing the CLI.

Aim (issue 23 item 15): `sftctl status` within 0.15 s on a quiet machine. It skips typer's
parameter parsing (whose adapters import pydantic): `python -X importtime -m sftctl.cli status
--json` shows what is left.

Peers measured in the same run: a bare `python -c pass` (the interpreter's own floor) and, when
SkyPilot is installed (`--sky PATH/TO/sky`, or `sky` on PATH), `sky status` on an empty state.
Prints a table and writes benchmarks/results/cli_latency.json.

    python benchmarks/cli_latency.py [--jobs 1000] [--repeat 15] [--sky /path/to/sky]
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
    for i in range(n_jobs):
        job = store.create_job("bench", spec)
        store.update_job(job, provider="local", offering_json=offering)
        for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.SUCCEEDED):
            store.transition(job, s)
        for rank in range(2):
            store.add_node(job, rank, "local", status="TERMINATED")
        store.record_metrics(job, [{"rank": r, "step": 300, "loss": 2.2, "step_time_s": 0.2,
                                    "tokens_per_s": 10000.0} for r in range(2)])


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
    args = ap.parse_args()

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
