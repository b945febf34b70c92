"""A provider is one module plus its tests (issue 39.3): ``tests/fixture_provider.py`` lives
outside sftctl and is registered only through ``SFTCTL_PROVIDERS`` (NAME=MODULE). The registry
finds its declaration, the spec and ``SFTCTL_CLOUDS`` take its name, the planner asks it for
offerings because it declares ``LiveOfferings``, and ``sftctl run`` plans and runs a job on it end
to end. No file under ``sftctl/`` names it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO, sftctl

from sftctl import providers, settings
from sftctl.errors import ProviderError
from sftctl.providers.base import KeepsAlive, LiveOfferings, PlacesController, QueueEstimate, Quarantines

TESTS = Path(__file__).resolve().parent
PLUGIN = "fixture=fixture_provider"


@pytest.fixture
def plugin(monkeypatch):
    """SFTCTL_PROVIDERS names the fixture; its module is importable (here and in CLI processes)."""
    monkeypatch.setenv("SFTCTL_PROVIDERS", PLUGIN)
    monkeypatch.syspath_prepend(str(TESTS))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def test_the_builtin_providers_are_the_packages_of_sftctl_providers():
    on_disk = sorted(p.parent.name for p in (REPO / "sftctl" / "providers").glob("*/__init__.py"))
    assert sorted(settings.builtin_providers()) == on_disk == ["aws", "gcp", "kubernetes", "local", "slurm"]
    assert settings.builtin_providers()[0] == "local"
    for name in on_disk:  # each declares itself once, under its own name
        assert providers.entry(name).name == name
        assert providers.provider_class(name).name == name


def test_the_declared_interfaces_are_what_each_provider_does():
    got = {name: sorted(i.__name__ for i in (KeepsAlive, Quarantines, QueueEstimate, LiveOfferings, PlacesController)
                        if issubclass(providers.provider_class(name), i))
           for name in settings.builtin_providers()}
    assert got == {"local": [], "aws": ["KeepsAlive"], "gcp": ["KeepsAlive"],
                   "kubernetes": ["KeepsAlive", "LiveOfferings", "PlacesController", "Quarantines"],
                   "slurm": ["KeepsAlive", "LiveOfferings", "PlacesController", "Quarantines", "QueueEstimate"]}


def test_a_plugin_is_registered_by_its_name_and_module(plugin):
    assert providers.names()[-1] == "fixture"
    assert settings.declared("SFTCTL_CLOUDS").parse("local,fixture") == ["local", "fixture"]
    assert providers.usable_providers()["fixture"] is None
    cls = providers.provider_class("fixture")
    assert cls.__module__ == "fixture_provider" and issubclass(cls, LiveOfferings)
    assert not issubclass(cls, (QueueEstimate, PlacesController))
    [offering] = cls.for_plan().offerings("cpu", 1)
    assert (offering.provider, offering.usd_per_hour) == ("fixture", 0.25)


def test_a_plugins_handle_is_found_without_importing_the_providers_first(home, plugin):
    """The state's reaper and the queue's waiting stage read a plugin job's capabilities and
    handles with only the state imported (no sftctl.providers): the module SFTCTL_PROVIDERS
    names is imported for its handle class (``unknown provider 'fixture'`` before)."""
    import subprocess
    import sys

    code = ("import sys; from sftctl.state import Store; from sftctl.types import NodeHandle, capabilities; "
            "assert 'sftctl.providers' not in sys.modules; c = capabilities('fixture'); "
            "h = NodeHandle.parse('fixture', {'job_id': 'j', 'node_id': 'n0', 'rank': 0}); "
            "print(c.local_admission, c.regional, type(h).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=plugin, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "FixtureHandle"]


def test_a_plugin_that_is_not_there_or_misnamed_is_one_line(monkeypatch):
    monkeypatch.setenv("SFTCTL_PROVIDERS", "ghost=no_such_module_here")
    assert providers.configured("ghost") == "provider 'ghost': its module 'no_such_module_here' is not importable"
    with pytest.raises(ProviderError, match="not importable"):
        providers.get_provider("ghost")
    monkeypatch.setenv("SFTCTL_PROVIDERS", "local=fixture_provider")
    with pytest.raises(settings.SettingError, match="'local' is a built-in provider's name"):
        providers.names()
    monkeypatch.setenv("SFTCTL_PROVIDERS", "fixture")
    with pytest.raises(settings.SettingError, match=r"expected NAME=MODULE .* got 'fixture'"):
        providers.names()


def test_without_the_plugin_the_spec_refuses_its_name(home, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("name: f\nrun: echo hi\nresources: {accelerators: ['cpu:1'], clouds: [fixture]}\n")
    env = {k: v for k, v in os.environ.items() if k != "SFTCTL_PROVIDERS"}
    proc = sftctl("plan", str(spec), env=env)
    assert proc.returncode == 2, proc.stderr
    assert "resources.clouds" in proc.stderr and "'fixture'" not in proc.stdout


def test_a_job_plans_and_runs_on_the_plugin_end_to_end(home, tmp_path, plugin):
    """The CLI process finds the fixture through SFTCTL_PROVIDERS, ranks its offering, runs the
    job's script on its node and keeps its handle; status and logs read it back."""
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: plugged\nworkdir: {tmp_path}\nrun: echo hello from the fixture provider\n"
                    "resources: {accelerators: ['cpu:1'], clouds: [fixture]}\n")
    plan = json.loads(sftctl("plan", str(spec), "--json", check=True, env=plugin).stdout)
    chosen = plan["chosen"]["offering"]
    assert (chosen["provider"], chosen["instance_type"], chosen["usd_per_hour"]) == ("fixture", "fixture-cpu-1", 0.25)
    proc = sftctl("run", str(spec), "--json", timeout=240, env=plugin)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["status"] == "SUCCEEDED" and doc["provider"] == "fixture", doc
    logs = sftctl("logs", doc["id"], check=True, env=plugin).stdout
    assert "hello from the fixture provider" in logs
    from sftctl.state import Store

    [node] = Store().nodes(doc["id"])
    assert node.provider == "fixture" and type(node.node_handle).__name__ == "FixtureHandle"


def test_nothing_in_sftctl_names_the_fixture():
    named = [str(p.relative_to(REPO)) for p in (REPO / "sftctl").rglob("*.py")
             if "fixture_provider" in p.read_text() or "FixtureProvider" in p.read_text()]
    assert named == []


def test_the_launch_request_asks_the_providers_interfaces_for_what_they_render(home, monkeypatch):
    """``admit`` renders a cloud node's secrets reference through SecretStore.secrets_ref_for (AWS)
    and nothing for a provider without one (GCP), and a node's objects through
    RendersNodeDocuments (Kubernetes), never by the provider's name."""
    from sftctl.catalog import cloud_offerings
    from sftctl.controller.launch import admit
    from sftctl.providers.aws import AWSProvider
    from sftctl.spec import JobSpec
    from sftctl.types import Plan, PlanChoice

    monkeypatch.setenv("SFTCTL_T_TOKEN", "x")
    spec = JobSpec.model_validate({"name": "r", "run": "true", "secrets": ["SFTCTL_T_TOKEN"],
                                   "storage": "s3://bucket/prefix", "resources": {"accelerators": ["H100:8"]}})
    refs = {}
    for cloud in ("aws", "gcp"):
        offering = next(o for o in cloud_offerings() if o.provider == cloud and o.accelerator == "H100")
        request = admit(spec, Plan(PlanChoice(offering, 1, None), "test", []))
        [node] = request.nodes
        refs[cloud] = [line for line in node.bootstrap.splitlines() if "SFTCTL_SECRETS_REF" in line]
        assert node.documents == ()
    ref = AWSProvider.secrets_ref_for("<job-id>")
    assert ref == "aws-sm://us-east-1/sftctl/-job-id-" and refs["aws"] == [f"export SFTCTL_SECRETS_REF={ref}"]
    assert refs["gcp"] == []
