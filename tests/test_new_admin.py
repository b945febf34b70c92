"""A lab admin's set-up of `sftctl server` (README's team set-up, docs/server.md), as a person
new to it does it: the mistakes found doing so, each against a real `sftctl server`."""

from __future__ import annotations

import html
import os
from urllib.parse import urlencode

import pytest

from conftest import sftctl

httpx = pytest.importorskip("httpx")


def test_metrics_token_on_a_laptop_whose_config_names_the_server_is_refused(server, home, tmp_path):
    """`sftctl server metrics-token` reads the scrape token of the server whose $SFTCTL_HOME it
    runs in. On a laptop whose config names the server it used to make a token of the laptop's
    own, print it and exit 0: a token the server refuses (401), so Prometheus never scraped.
    Now it says where the token lives, in one line, exit 2, and writes nothing; --local keeps
    the old behaviour for a server machine whose config names a server."""
    laptop = tmp_path / "laptop"
    env = {**os.environ, "SFTCTL_HOME": str(laptop), "SFTCTL_SERVER_URL": server.url,
           "SFTCTL_SERVER_TOKEN": "sft_not-needed-to-refuse"}
    proc = sftctl("server", "metrics-token", env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert not (laptop / "metrics.token").exists()
    error, hint = proc.stderr.strip().splitlines()
    assert error.startswith("error: server metrics-token:") and server.url in error
    assert hint.startswith("hint:") and "server's machine" in hint and "--local" in hint

    # on the server's machine (its $SFTCTL_HOME) the token printed is the one /metrics takes
    token = sftctl("server", "metrics-token", check=True).stdout.strip()
    r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200 and "sftctl_jobs" in r.text

    # --local: this machine's token even where the config names a server
    local = sftctl("server", "metrics-token", "--local", env=env, check=True).stdout.strip()
    assert (laptop / "metrics.token").read_text().strip() == local and local != token


SKEWED = """\
import os, pathlib, time
from sftctl.train import report

# this node's clock runs an hour behind the other's: its reports carry that clock's times
skew = -3600.0 if os.environ.get("SFTCTL_NODE_RANK") == "1" else 0.0
real = time.time
for step in range(1, 7):
    while step == 4 and not pathlib.Path("more").exists():
        time.sleep(0.2)
    time.time = lambda: real() + skew
    try:
        report(step=step, loss=1.0 / step, tokens_per_s=1000.0, step_time_s=0.1)
    finally:
        time.time = real
print("reported six steps", flush=True)
time.sleep(300)
"""


def test_a_job_page_draws_every_rank_live_when_a_nodes_clock_is_behind(server, tmp_path, monkeypatch):
    """Each node stamps its steps with its own clock. The page's live updates asked for the
    points after the newest one it had drawn, over all ranks: a rank whose node's clock is
    behind got none of its new points (a 2-node job with a 3 s skew drew 92 of 300 steps of
    that rank while the state held all 300). Each rank (and each node's GPUs) now has its own
    cursor."""
    from conftest import job_processes, wait_for
    from test_server import as_user, tokens
    from test_web_browser import CHROMIUM, sync_api  # skips without chromium or playwright

    from sftctl import api
    from sftctl.state import Store

    t = tokens("alice")
    as_user(monkeypatch, server, t["alice"])
    work = tmp_path / "work"
    work.mkdir()
    (work / "skewed.py").write_text(SKEWED)
    spec = tmp_path / "skewed.yaml"
    spec.write_text(f"name: skewed\nworkdir: {work}\ntrain: {{steps: 6}}\nresources: {{nodes: 2}}\n"
                    "env: {SFTCTL_HEARTBEAT_S: '0'}\nrun: python skewed.py\n")
    job = api.run(str(spec), detach=True).id

    def steps(rank: int) -> list[int]:
        return [s.step for s in Store().step_series(job, rank=rank)]

    try:
        wait_for(lambda: steps(0) == steps(1) == [1, 2, 3], timeout_s=180, what="both ranks' first 3 steps")
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--no-first-run", "--disable-extensions"])
            try:
                page = browser.new_page()
                page.goto(f"{server.url}/ui/login")
                page.fill("#token", t["alice"])
                page.click("#signin")
                page.wait_for_url("**/ui/jobs")
                page.goto(f"{server.url}/ui/jobs/{job}")
                page.wait_for_selector("#chart-loss canvas", timeout=60_000)
                drawn = "r => window.sftctlCurves.steps[r] ? window.sftctlCurves.steps[r].step : []"
                assert page.evaluate(drawn, "0") == page.evaluate(drawn, "1") == [1, 2, 3]
                page.wait_for_timeout(2500)  # the stream is open, past its first poll
                (work / "more").write_text("")
                wait_for(lambda: steps(0) == steps(1) == [1, 2, 3, 4, 5, 6], timeout_s=120,
                         what="both ranks' 6 steps in the state")
                page.wait_for_function("() => ['0', '1'].every(r => (window.sftctlCurves.steps[r] || {step: []})"
                                       ".step.length >= 6)", timeout=60_000)
                assert page.evaluate(drawn, "0") == page.evaluate(drawn, "1") == [1, 2, 3, 4, 5, 6]
                for bad in ("nope", '{"ranks": {"0": "NaN"}}', '{"ranks": {"x": 1}}'):
                    r = page.goto(f"{server.url}/ui/jobs/{job}/stream?" + urlencode({"cursors": bad}))
                    assert r is not None and r.status == 400 and "cursors: expected" in page.inner_text("body")
            finally:
                browser.close()
    finally:
        api.down(job)
        wait_for(lambda: job_processes(job) == [], timeout_s=60, what="the job's processes to end")


def test_the_forecast_of_a_job_without_a_model_uses_its_reported_step_time(home):
    """docs/server.md: the forecast is the cost so far + the remaining steps at the measured
    step time (the predicted one before any is measured). A job without `model:` has no
    prediction, and status measures its step only against one, so its forecast was "–" on the
    jobs table and its page however many steps it had reported: now the ranks' latest reported
    step time (their mean) prices its remaining steps. Two nodes at $98.32/h, 1 node-hour each
    so far, 100 of 1000 steps done at 1.8 s/step: 196.64 + 900 x 1.8 s x 2 nodes x 98.32 $/h."""
    import time

    from test_cost import OFFERING

    from sftctl import api
    from sftctl.server.web import forecast_usd
    from sftctl.state import JobStatus, NodeState, Store

    store = Store()
    job = store.create_job("nomodel", {"name": "nomodel", "train": {"steps": 1000}, "resources": {"nodes": 2},
                                       "run": "python train.py"}, owner="alice")
    store.update_job(job, provider="aws", offering_json={"offering": OFFERING})
    now = time.time()
    for rank in range(2):
        node = store.add_node(job, rank, "aws")
        store._conn.execute("UPDATE nodes SET created_at = ?, ended_at = ? WHERE id = ?", (now - 7200, now - 3600, node))
        store.update_node(node, status=NodeState.TERMINATED)
    for s in (JobStatus.PROVISIONING, JobStatus.LAUNCHING, JobStatus.RUNNING):
        store.transition(job, s)
    assert forecast_usd(api.status(job)) is None  # no step reported: nothing to price the rest at
    store.record_metrics(job, [{"rank": r, "step": step, "loss": 2.0, "step_time_s": st, "ts": now - 3600 + step}
                               for step in (99, 100) for r, st in ((0, 1.7), (1, 1.9))])
    view = api.status(job)
    assert view.step_time is None and view.step == 100 and view.cost.usd == pytest.approx(196.64)
    assert forecast_usd(view) == pytest.approx(196.64 + 900 * 1.8 / 3600 * 2 * 98.32)
    store.close()


def test_the_costs_page_refuses_a_period_that_is_not_a_number_of_days(server):
    """The costs page's "over the last N days" field: "abc" answered the browser with the JSON
    API's document ("the client and the server are different sftctl versions?"), -1 showed "no
    cost yet" (a period that starts tomorrow) and 0 every job's cost of all time. Each is now
    the page again, 400, with one line naming the field and what it takes."""
    from test_server import tokens
    from test_web import signed_in

    alice = signed_in(server, tokens("alice")["alice"])
    for bad in ("abc", "-1", "0", "nan", "inf", "1e400"):
        r = alice.get("/ui/costs", params={"days": bad})
        assert r.status_code == 400 and r.headers["content-type"].startswith("text/html"), (bad, r.text[:300])
        assert f"days: {bad!r} is not a number of days above 0" in html.unescape(r.text)
        assert "no cost yet" not in r.text
    for good in ("", "7", "0.5"):
        r = alice.get("/ui/costs", params={"days": good})
        assert r.status_code == 200 and "no cost yet" in r.text and 'class="error"' not in r.text


def test_a_state_outage_is_not_a_sign_in_error_on_the_dashboard(pg_url, postgres, home, tmp_path):
    """With the server's Postgres down, a signed-in page sent its user back to the sign-in form
    (its error line the database's), and signing in again answered 401 as a bad token does: a
    person takes it for their token's fault. Now the page says the state is unreachable, with the
    API's status and hint, and keeps the session; once Postgres is back the same cookie works."""
    from test_server import Server, tokens
    from test_web import signed_in

    server = Server(home, tmp_path / "server.log").start()  # inherits SFTCTL_STATE_URL: Postgres
    try:
        token = tokens("alice")["alice"]
        alice = signed_in(server, token)
        assert alice.get("/ui/jobs").status_code == 200
        postgres.stop()
        try:
            r = alice.get("/ui/jobs")
            assert r.status_code not in (200, 303) and "database is unavailable" in r.text, (r.status_code, r.text[:300])
            assert "Sign in" not in r.text
            r = alice.post("/ui/login", content=f"token={token}",
                           headers={"content-type": "application/x-www-form-urlencoded"})
            assert r.status_code not in (303, 401) and "database is unavailable" in r.text, (r.status_code, r.text[:300])
        finally:
            postgres.start()
        r = alice.get("/ui/jobs")  # the same session, the database back
        assert r.status_code == 200 and "Jobs" in r.text
    finally:
        server.stop()
