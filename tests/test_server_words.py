"""What ``sftctl server start`` tells the person who started it."""

from __future__ import annotations

from conftest import wait_for
from test_server import Server


def test_server_start_says_its_url_and_the_next_step(home, tmp_path):
    """It said only "reconciled: 0 job(s) given a controller"; jupyter and mlflow ui say their URL."""
    log = tmp_path / "server.log"
    server = Server(home, log).start()
    try:
        said = wait_for(lambda: "listening on" in log.read_text() and log.read_text(), timeout_s=60,
                        what="the server's first words")
        assert f"listening on {server.url} (Ctrl-C stops it)" in said
        assert "sftctl server user add NAME" in said
        assert f"server: {{url: {server.url}, token: TOKEN}}" in said and f"SFTCTL_SERVER_URL={server.url}" in said
    finally:
        server.stop()


def test_an_attached_plain_script_through_the_server_shows_no_step_total(server, tmp_path, monkeypatch):
    """The server returns the job's spec with every default filled in: the bar's total must come
    from what the user wrote (no train.steps: no total), as a local run's does."""
    import os

    from conftest import sftctl
    from test_server import as_user, tokens

    as_user(monkeypatch, server, tokens("alice")["alice"])
    spec = tmp_path / "plain.yaml"
    spec.write_text("name: plain\nrun: echo hello\n")
    proc = sftctl("run", str(spec), env={**os.environ, "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    [bar] = [ln for ln in proc.stdout.splitlines() if ln.startswith("succeeded")]
    assert "0/?" in bar and "/100" not in bar, proc.stdout


def test_a_port_out_of_range_is_a_usage_error_and_a_foreign_host_is_named(home):
    """--port 99999 was "internal error: OverflowError" (exit 1, "state database may be damaged");
    --host 999.1.1.1 was "another server runs there?"."""
    from conftest import no_traceback, sftctl

    for args in (("server", "start", "--port", "99999"), ("server", "start", "--port", "-1"),
                 ("server", "manifest", "--systemd", "--port", "70000")):
        proc = sftctl(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "'--port'" in proc.stderr and ("65535" in proc.stderr or "equal to 1" in proc.stderr), proc.stderr
        assert "internal error" not in proc.stderr and no_traceback(proc)
    for host in ("999.1.1.1", "192.0.2.1"):  # no such address; TEST-NET-1, on no machine
        proc = sftctl("server", "start", "--host", host, "--port", "8470")
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.splitlines()
        assert lines[0].startswith(f"error: sftctl server: cannot listen on {host}:8470: ")
        assert lines[0].endswith(f"{host} is not an address of this machine"), proc.stderr
        assert "another server" not in proc.stderr and "--host" in lines[1], proc.stderr
