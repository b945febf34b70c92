"""The dashboard in a real browser (issue 36): Debian's chromium driven by Playwright against a
real `sftctl server` on a real Postgres with real local jobs: sign-in with a token, the jobs
row, a job's loss chart drawn on a canvas, the table following a job that ends (server-sent
events, no reload), and `down` from the page cancelling the job.

Playwright's own browser download does not work here: the test launches /usr/bin/chromium
(`apt-get install chromium`; .ci/run installs it) and skips, saying so, only when it is absent.
``SFTCTL_WEB_SCREENSHOT=path.png`` keeps a screenshot of the job page (README's docs/ image).
"""

from __future__ import annotations

import os
import shutil
import time

import pytest

from conftest import REPO, job_processes, wait_for
from test_server import Server, as_user, tokens
from test_web import reporter_spec

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("no chromium (apt-get install chromium): the browser test needs Debian's build",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")


@pytest.fixture
def server(pg_url, home, tmp_path):
    s = Server(home, tmp_path / "server.log").start()  # inherits SFTCTL_STATE_URL: Postgres
    yield s
    s.stop()


def test_sign_in_watch_a_job_end_and_take_one_down_in_chromium(server, tmp_path, monkeypatch):
    from sftctl import api
    from sftctl.state import Store

    t = tokens("alice", "bob")
    as_user(monkeypatch, server, t["alice"])
    # its node's health agent replays a recorded H200 under load: GPU curves to draw
    replay = {"SFTCTL_TELEMETRY_REPLAY": str(REPO / "tests/fixtures/healthy_h200_load.jsonl")}
    reporting = api.run(str(reporter_spec(tmp_path, "reporting", env=replay)), detach=True).id
    gate = tmp_path / "gate"
    gate.mkdir()
    waiting = tmp_path / "waiting.yaml"
    waiting.write_text(f"name: waiting\nworkdir: {gate}\nresources: {{nodes: 1}}\n"  # a sandboxed node sees its workdir
                       f"run: while [ ! -f go ]; do sleep 0.2; done; echo went\n")
    waits = api.run(str(waiting), detach=True).id
    as_user(monkeypatch, server, t["bob"])  # bob's job (it may wait for the machine's CPUs: a row all the same)
    bobs = api.run(str(reporter_spec(tmp_path, "bobs")), detach=True).id
    as_user(monkeypatch, server, t["alice"])
    wait_for(lambda: len(Store().step_series(reporting)) == 5, timeout_s=120, what="the job to report 5 steps")
    wait_for(lambda: len(Store().gpu_series(reporting)) >= 5, timeout_s=120, what="the node's GPU samples")
    wait_for(lambda: api.status(waits).status.value == "RUNNING", timeout_s=120, what="the waiting job to run")

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--no-first-run", "--disable-extensions"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("dialog", lambda d: d.accept())
            errors: list[str] = []  # the console's errors and uncaught exceptions, each with its URL
            page.on("console", lambda m: m.type == "error" and errors.append(f"{m.text} ({m.location.get('url')})"))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{server.url}/")
            assert page.url.endswith("/ui/login")
            page.fill("#token", t["alice"])
            started = time.monotonic()
            page.click("#signin")
            page.wait_for_selector(f'tr.job[data-job="{reporting}"]', timeout=60_000)
            jobs_load_s = time.monotonic() - started
            ids = page.eval_on_selector_all("tr.job", "rows => rows.map(r => r.dataset.job)")
            assert sorted(ids) == sorted([reporting, waits]) and bobs not in ids  # bob's job: not shown

            # the table follows the jobs: the waiting job ends, the page changes without a reload
            page.evaluate("window.__same_page = true")
            page.wait_for_timeout(1500)  # the event stream is open
            (gate / "go").write_text("")
            page.wait_for_selector(f'tr.job[data-job="{waits}"][data-status="SUCCEEDED"]', timeout=120_000)
            assert page.evaluate("window.__same_page") is True

            # down from the page cancels the job
            page.click(f'tr.job[data-job="{reporting}"] button.down')
            page.wait_for_selector(f'tr.job[data-job="{reporting}"][data-status="CANCELLED"]', timeout=120_000)
            assert api.status(reporting).status.value == "CANCELLED"

            # a job's page: the loss chart is a canvas with the points its rank reported
            started = time.monotonic()
            page.goto(f"{server.url}/ui/jobs/{reporting}")
            page.wait_for_selector("#chart-loss canvas", timeout=60_000)
            job_load_s = time.monotonic() - started
            legend = page.inner_text("#chart-loss")
            assert "rank 0" in legend
            page.wait_for_selector("#gpu-0-util canvas", timeout=30_000)  # the node's GPU curves
            series = page.evaluate("JSON.parse(document.getElementById('series').textContent)")
            assert series["ranks"]["0"]["step"] == [1, 2, 3, 4, 5]
            shot = os.environ.get("SFTCTL_WEB_SCREENSHOT")
            page.screenshot(path=shot or str(tmp_path / "job.png"), full_page=True)
            assert errors == []  # no failed load (a favicon answered 401 on every page), no script error
            assert page.goto(f"{server.url}/ui/jobs/{bobs}").status == 404
            print(f"jobs page after sign-in {jobs_load_s:.2f} s; job page {job_load_s:.2f} s")
        finally:
            browser.close()
    as_user(monkeypatch, server, t["bob"])
    api.down(bobs)
    for j in (reporting, bobs):
        wait_for(lambda j=j: job_processes(j) == [], timeout_s=60, what="the jobs' processes to end")
