"""`sftctl status --json` through an sftctl server against the SQLite path, in the same run (issue 24).

A state of 1,000 finished jobs (2 nodes, metrics and 6 events each: benchmarks/cli_latency.py's
`populate`), all one user's (the server's user of this machine's name). 10 client threads poll `status --json` at once, each `--polls`
times, two ways:

- `cli`: each poll is a `sftctl status --json` process (what a script or a prompt runs), with
  the config naming the server (`SFTCTL_SERVER_URL`/`TOKEN`), then without (SQLite, this
  machine's state.db);
- `api`: each poll is `[v.to_dict() for v in sftctl.api.status()]` in this process (no
  interpreter start), through the server, then on SQLite.

The server is `sftctl server start` on a loopback port, a process of its own. Prints p50/p99
latency per path and writes benchmarks/results/server_status.json.

    python benchmarks/server_status.py [--jobs 1000] [--threads 10] [--polls 5]
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
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "server_status.json"


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def poll(threads: int, polls: int, once) -> list[float]:
    """Seconds per call of ``once()`` from ``threads`` threads at once, ``polls`` calls each."""
    out: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker():
        for _ in range(polls):
            t0 = time.perf_counter()
            try:
                once()
            except BaseException as e:  # noqa: BLE001 (reported after the run)
                errors.append(e)
                return
            with lock:
                out.append(time.perf_counter() - t0)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise SystemExit(f"a poll failed: {errors[0]!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=10)
    ap.add_argument("--polls", type=int, default=5)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="sftctl-server-bench-"))
    home = tmp / "home"
    os.environ.update(SFTCTL_HOME=str(home), XDG_CONFIG_HOME=str(tmp / "xdg"))
    os.environ.pop("SFTCTL_CONFIG", None)
    for k in ("SFTCTL_SERVER_URL", "SFTCTL_SERVER_TOKEN"):
        os.environ.pop(k, None)
    sys.path.insert(0, str(HERE))
    from cli_latency import populate

    t0 = time.perf_counter()
    populate(home, args.jobs)
    from sftctl.server.users import add_user
    from sftctl.state import os_user

    token = add_user(os_user())  # populate's jobs are this machine's user's
    print(f"state: {args.jobs} jobs in {time.perf_counter() - t0:.1f} s")

    from _server import sftctl_server

    with sftctl_server() as url:
        served = {**os.environ, "SFTCTL_SERVER_URL": url, "SFTCTL_SERVER_TOKEN": token}
        local = dict(os.environ)
        cmd = [sys.executable, "-m", "sftctl.cli", "status", "--json"]

        def cli(env):
            def once():
                proc = subprocess.run(cmd, capture_output=True, env=env)
                if proc.returncode != 0 or len(json.loads(proc.stdout)["jobs"]) != args.jobs:
                    raise RuntimeError(proc.stderr.decode()[-500:])
            return once

        from sftctl import api

        def in_process(server_env: bool):
            def once():
                docs = [v.to_dict() for v in api.status()]
                if len(docs) != args.jobs:
                    raise RuntimeError(f"{len(docs)} jobs")
            return once

        cli(served)(), cli(local)()  # warm: the page cache, the server's first request
        rows = {}
        for mode, path, once in (("cli", "server", cli(served)), ("cli", "sqlite", cli(local))):
            rows[(mode, path)] = poll(args.threads, args.polls, once)
        os.environ.update(SFTCTL_SERVER_URL=url, SFTCTL_SERVER_TOKEN=token)
        in_process(True)()
        rows[("api", "server")] = poll(args.threads, args.polls, in_process(True))
        for k in ("SFTCTL_SERVER_URL", "SFTCTL_SERVER_TOKEN"):
            os.environ.pop(k)
        rows[("api", "sqlite")] = poll(args.threads, args.polls, in_process(False))

    results = []
    print(f"{'MODE':5} {'PATH':7} {'N':>4} {'P50 s':>8} {'P99 s':>8} {'MEAN s':>8}")
    for (mode, path), xs in rows.items():
        r = {"mode": mode, "path": path, "n": len(xs), "p50_s": round(pct(xs, 0.5), 4),
             "p99_s": round(pct(xs, 0.99), 4), "mean_s": round(statistics.mean(xs), 4)}
        results.append(r)
        print(f"{mode:5} {path:7} {r['n']:>4} {r['p50_s']:>8.3f} {r['p99_s']:>8.3f} {r['mean_s']:>8.3f}")
    ratios = {mode: round(next(r["p50_s"] for r in results if r["mode"] == mode and r["path"] == "server")
                          / next(r["p50_s"] for r in results if r["mode"] == mode and r["path"] == "sqlite"), 2)
              for mode in ("cli", "api")}
    print(f"p50 server / sqlite: cli {ratios['cli']}x, api {ratios['api']}x")
    load = os.getloadavg()
    doc = {"benchmark": "server_status", "jobs": args.jobs, "threads": args.threads, "polls_per_thread": args.polls,
           "results": results, "p50_server_over_sqlite": ratios,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load_1_5_15": [round(x, 2) for x in load]},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
