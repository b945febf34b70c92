"""The dashboard's page load times in a real browser (issue 36): the jobs page with 1,000 jobs
and a job page with 100,000 step points (10 ranks x 10,000, STEP_SERIES_CAP each).

A fresh SQLite state (benchmarks/cli_latency.py's `populate`: 1,000 finished jobs of this
machine's user) plus one job whose 10 ranks reported 10,000 steps each; `sftctl server start` on
a loopback port; Debian's chromium driven by Playwright signs in and loads each page
``--repeat`` times: from navigation to the last row in the DOM (jobs) or to the loss chart's
canvas (job). Also the server's own time for each page (httpx). Prints and writes
benchmarks/results/dashboard_pages.json.

    python benchmarks/dashboard_pages.py [--jobs 1000] [--ranks 10] [--steps 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "dashboard_pages.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="sftctl-dash-"))
    sys.path.insert(0, str(HERE))
    from cli_latency import populate

    populate(home, args.jobs)
    from sftctl.server.users import add_user
    from sftctl.state import JobStatus, Store, os_user

    store = Store()
    spec = {"name": "big", "resources": {"nodes": 1}, "train": {"steps": args.steps}, "run": "true"}
    big = store.create_job("big", spec)
    for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING, JobStatus.SUCCEEDED):
        store.transition(big, s)
    t0 = 1_700_000_000.0
    for start in range(0, args.steps, 1000):
        store.record_metrics(big, [{"rank": r, "step": s + 1, "loss": 5.0 / (s + 1) ** 0.3, "step_time_s": 0.2,
                                    "tokens_per_s": 1e5, "ts": t0 + s * 0.2}
                                   for s in range(start, min(args.steps, start + 1000)) for r in range(args.ranks)])
    points = len(store.step_series(big))
    token = add_user(os_user())
    from _server import sftctl_server
    import httpx

    with sftctl_server({**os.environ, "SFTCTL_HOME": str(home)}) as url:
        client = httpx.Client(base_url=url, timeout=120, cookies={"sftctl_session": token})
        server_s: dict[str, list[float]] = {"jobs": [], "job": []}
        for _ in range(args.repeat):
            for name, path in (("jobs", "/ui/jobs"), ("job", f"/ui/jobs/{big}")):
                t = time.perf_counter()
                r = client.get(path)
                server_s[name].append(time.perf_counter() - t)
                assert r.status_code == 200, (path, r.status_code)
        from playwright.sync_api import sync_playwright

        browser_s: dict[str, list[float]] = {"jobs": [], "job": []}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{url}/ui/login")
            page.fill("#token", token)
            page.click("#signin")
            page.wait_for_selector("tr.job", timeout=120_000)
            for _ in range(args.repeat):
                t = time.perf_counter()
                page.goto(f"{url}/ui/jobs")
                page.wait_for_function(f"document.querySelectorAll('tr.job').length >= {args.jobs + 1}", timeout=120_000)
                browser_s["jobs"].append(time.perf_counter() - t)
                t = time.perf_counter()
                page.goto(f"{url}/ui/jobs/{big}")
                page.wait_for_selector("#chart-loss canvas", timeout=120_000)
                browser_s["job"].append(time.perf_counter() - t)
            browser.close()
    doc = {"jobs": args.jobs + 1, "job_points": points, "repeat": args.repeat,
           "browser_s": {k: {"median": statistics.median(v), "max": max(v)} for k, v in browser_s.items()},
           "server_s": {k: {"median": statistics.median(v), "max": max(v)} for k, v in server_s.items()},
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "when": time.strftime("%Y-%m-%d")}
    print(json.dumps(doc, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
