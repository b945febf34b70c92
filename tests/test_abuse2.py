"""What a server's user or a user's job may not do: act as the server, as the controller or as
another user, with a real ``sftctl server`` on SQLite and real clients.

- a user's ``model:`` entrypoint is never imported by the server (its submit, the dashboard's
  plan page): the model's module code would run in the server's process, with its state
  (every user's token hash, the secrets key) and its environment.
"""

from __future__ import annotations

import pytest

from conftest import deadline

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from test_server import Server, as_user, tokens


@pytest.fixture
def server(home, tmp_path):
    s = Server(home, tmp_path / "server.log").start()
    yield s
    s.stop()


def _model_that_reports(tmp_path):
    """A workdir whose ``evil.py`` writes ``ran.txt`` (the importing process's pid) when
    imported, and a spec naming it as ``model:``. Returns (spec path, marker path)."""
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran.txt"
    (work / "evil.py").write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\n"
        "def build(batch_size, dtype='float32'):\n"
        "    raise RuntimeError('never built')\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: evil\nworkdir: {work}\nmodel: {{entrypoint: evil.py:build, batch_size: 1}}\n"
                    "resources: {nodes: 1}\nrun: echo hi\n")
    return spec, marker


def test_the_server_never_imports_a_users_model_code(server, tmp_path, monkeypatch):
    """alice's submit with a ``model:`` is planned by price only on the server, with a warning
    saying so; her module never runs in the server's process."""
    import warnings

    from sftctl import api
    from sftctl.errors import SftctlWarning

    spec, marker = _model_that_reports(tmp_path)
    as_user(monkeypatch, server, tokens("alice")["alice"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = api.submit(str(spec)).job_id
    try:
        assert not marker.exists(), f"the server (pid {server.proc.pid}) ran alice's model code: pid {marker.read_text()}"
        said = [str(w.message) for w in caught if issubclass(w.category, SftctlWarning)]
        assert any("price only" in s and "model" in s for s in said), said
    finally:
        api.down(job)
        api.wait(job, timeout_s=deadline(120))
