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
