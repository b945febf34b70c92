"""What users trip over (issue 14): each test here failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, job_processes, no_traceback, sftctl, status_json, wait_for, write_spec

# An interpreter without the cloud SDKs (the README's plain `.[torch]` install): a meta-path
# finder refuses them the way a missing distribution does.
NO_SDKS = textwrap.dedent("""\
    import sys
    class _NoSdk:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("kubernetes", "google", "boto3", "botocore"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoSdk())
    from sftctl.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _credentials_everywhere(tmp_path) -> dict:
    """A HOME with a kubeconfig, GCP and AWS credentials set: every cloud looks configured."""
    h = tmp_path / "user"
    (h / ".kube").mkdir(parents=True)
    (h / ".kube" / "config").write_text("apiVersion: v1\nkind: Config\n")
    adc = tmp_path / "adc.json"
    adc.write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "KUBE", "GOOGLE_"))}
    return {**env, "HOME": str(h), "GOOGLE_APPLICATION_CREDENTIALS": str(adc), "AWS_ACCESS_KEY_ID": "x",
            "AWS_SECRET_ACCESS_KEY": "y"}


def test_check_and_down_orphans_without_cloud_sdks_name_the_extra(tmp_path, home):
    """Item 1: no traceback when credentials exist but an SDK does not; every cloud names its extra."""
    env = _credentials_everywhere(tmp_path)
    run = lambda *a: subprocess.run([sys.executable, "-c", NO_SDKS, *a], capture_output=True, text=True,
                                    env=env, cwd=REPO, timeout=120)
    proc = run("check", "--json")
    assert no_traceback(proc), proc.stderr
    assert proc.returncode == 4
    rows = {r["cloud"]: r for r in json.loads(proc.stdout)["clouds"]}
    for cloud, sdk in (("aws", "boto3"), ("gcp", "google.cloud.compute_v1"), ("kubernetes", "kubernetes")):
        assert rows[cloud]["ok"] is False
        assert rows[cloud]["reason"] == f"{cloud}: its SDK ({sdk}) is not installed"
        assert rows[cloud]["hint"] == f"pip install 'sftctl[{cloud}]'"
    table = run("check")
    assert no_traceback(table) and "pip install 'sftctl[kubernetes]'" in table.stdout
    proc = run("down", "--orphans")
    assert proc.returncode == 0 and no_traceback(proc), proc.stderr
    assert proc.stdout.splitlines() == [f"{c}: skipped ({c}: its SDK ({s}) is not installed)"
                                        for c, s in (("aws", "boto3"), ("gcp", "google.cloud.compute_v1"),
                                                     ("kubernetes", "kubernetes"))]
