"""A lab admin's set-up of `sftctl server` (README's team set-up, docs/server.md), as a person
new to it does it: the mistakes found doing so, each against a real `sftctl server`."""

from __future__ import annotations

import os

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
