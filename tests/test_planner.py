"""The planner: filters (clouds, spot, price, memory, deadline, usable), objective, reasons."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from conftest import write_spec
from sftctl.errors import InfeasibleError, SpecError
from sftctl.planner import plan
from sftctl.spec import JobSpec, load_spec
from sftctl.types import FailureCode, FailureReason

ALL_USABLE = {"local": None, "aws": None, "gcp": None, "kubernetes": None}


def spec(tmp_path, resources: str, steps: int = 1000):
    return load_spec(write_spec(tmp_path / "job.yaml", f"name: job\ntrain: {{steps: {steps}}}\nresources: {resources}\nrun: echo\n"))


def fixed_predictor(step_s: dict[str, float], peak=10 * 2**30, needed=None):
    """Predicts a step time per accelerator name (DDP only, ``peak`` bytes per device against the
    catalog's memory); ``needed``: the devices plain data parallel would need where it does not fit."""
    from sftctl.catalog.accelerators import get_accelerator
    from sftctl.compiler.api import OfferingPrediction
    from sftctl.compiler.sharding import StrategyPrediction, choose
    from sftctl.compiler.step import StepPrediction

    needed = needed or {}

    def predict(offering, nodes):
        t, world = step_s[offering.accelerator], offering.count * nodes
        cap = get_accelerator(offering.accelerator).memory_bytes
        step = StepPrediction(offering.accelerator, world, t, 0.0, t, peak, cap, needed.get(offering.accelerator, 1))
        ddp = StrategyPrediction("ddp", False, world, t, 0.0, t, peak, cap, {})
        return OfferingPrediction(step, (ddp,), *choose([ddp]))

    return predict


def test_cheapest_total_wins_not_cheapest_hourly(tmp_path):
    s = spec(tmp_path, "{accelerators: [H100:8, A100-40GB:8], clouds: [aws]}")
    # H100 node $55.04/h, A100 node $21.96/h: A100 must be > 2.5x slower to lose
    p = plan(s, ALL_USABLE, fixed_predictor({"H100": 0.1, "A100-40GB": 0.3}))
    assert p.offering.accelerator == "H100"
    # 1000 steps of 0.1 s and the preflight's stated 15 s + dcgmi diag -r 1's 15 s on a GPU node
    assert p.chosen.total_usd == pytest.approx(55.04 * (0.1 * 1000 + 30) / 3600)
    p = plan(s, ALL_USABLE, fixed_predictor({"H100": 0.1, "A100-40GB": 0.2}))
    assert p.offering.accelerator == "A100-40GB"
    assert "cheapest of" in p.reason and "ms/step" in p.reason


def test_objective_time_takes_fastest_within_price(tmp_path):
    s = spec(tmp_path, "{accelerators: [H100:8, A100-40GB:8], clouds: [aws], objective: time, max_price_per_hour: 30}")
    p = plan(s, ALL_USABLE, fixed_predictor({"H100": 0.1, "A100-40GB": 0.3}))
    assert p.offering.accelerator == "A100-40GB"  # H100 is faster but above the price cap
    rejected = {(c.offering.instance_type, c.offering.region): c.rejected for c in p.candidates if c.rejected}
    p5 = rejected["p5.48xlarge", "us-east-1"]
    assert p5.message == "$55.04/h is above max_price_per_hour $30.00"
    assert p5.code is FailureCode.OVER_BUDGET
    assert p5.data == {"usd_per_hour": 55.04, "max_price_per_hour": 30.0}


def test_deadline_rejects_slow_offerings(tmp_path):
    s = spec(tmp_path, "{accelerators: [H100:8, A100-40GB:8], clouds: [aws], deadline: 1h}", steps=10000)
    p = plan(s, ALL_USABLE, fixed_predictor({"H100": 0.3, "A100-40GB": 0.5}))
    assert p.offering.accelerator == "H100"  # the A100 is cheaper but takes 1.4 h
    a100 = [c for c in p.candidates if c.offering.accelerator == "A100-40GB" and c.offering.provider == "aws"]
    assert all(c.rejected.message == "predicted 1.4 h is past the deadline of 1h" for c in a100)
    assert {c.rejected.code for c in a100} == {FailureCode.TOO_SLOW}


def test_memory_and_spot_and_usable(tmp_path):
    s = spec(tmp_path, "{accelerators: [L4:1, T4:1], spot: true}")
    p = plan(s, {**ALL_USABLE, "gcp": "gcp credentials not found"},
             fixed_predictor({"L4": 1.0, "T4": 2.0}, peak=20 * 2**30, needed={"T4": 2}))
    assert p.offering.provider == "aws" and p.offering.accelerator == "L4"
    assert p.chosen.usd_per_hour == p.offering.spot_usd_per_hour  # spot allowed: spot price
    reasons = {(c.offering.provider, c.offering.accelerator): c.rejected for c in p.candidates}
    assert reasons[("gcp", "L4")] == FailureReason(FailureCode.NOT_CONFIGURED, "gcp credentials not found")
    assert reasons[("aws", "T4")].message.startswith("nothing fits: ddp needs 20.0 GiB per device of 16 GiB")
    assert reasons[("aws", "T4")].code is FailureCode.DOES_NOT_FIT
    assert reasons[("aws", "T4")].data["devices_needed"] == 2


def test_reason_names_the_providers_not_usable_here(tmp_path):
    """The plan's reason ends with the providers whose offerings were ruled out only because
    they are not configured here (computed from the rejections' codes, not their text)."""
    s = spec(tmp_path, "{accelerators: [L4:1], clouds: [aws, gcp]}")
    p = plan(s, {**ALL_USABLE, "gcp": "gcp: no credentials (run gcloud auth application-default login)"},
             fixed_predictor({"L4": 1.0}))
    assert p.offering.provider == "aws"
    assert p.reason.endswith("; not usable here: gcp"), p.reason
    everything = plan(s, ALL_USABLE, fixed_predictor({"L4": 1.0}))
    assert "not usable here" not in everything.reason


def test_on_demand_price_unless_spot(tmp_path):
    p = plan(spec(tmp_path, "{accelerators: [L4:1], clouds: [aws]}"), ALL_USABLE, fixed_predictor({"L4": 1.0}))
    assert p.chosen.usd_per_hour == p.offering.usd_per_hour


def test_nothing_feasible_says_why(tmp_path):
    s = spec(tmp_path, "{accelerators: [H100:8], clouds: [aws], max_price_per_hour: 1}")
    with pytest.raises(InfeasibleError) as e:
        plan(s, ALL_USABLE, fixed_predictor({"H100": 0.1}))
    assert e.value.exit_code == 3
    assert "is above max_price_per_hour $1.00" in e.value.message
    assert len(e.value.candidates) >= 1


def test_unknown_accelerator_suggests(tmp_path):
    # load_spec says it at its line (tests/test_lifecycle.py); the planner, for a spec made otherwise
    s = JobSpec.model_validate({"name": "job", "run": "echo", "resources": {"accelerators": ["H10:8"]}})
    with pytest.raises(SpecError, match=r"^resources.accelerators\[0\]: unknown accelerator 'H10'; did you mean 'H100'\?"):
        plan(s, ALL_USABLE)


def test_local_cpu_without_model_ranks_by_price(tmp_path):
    p = plan(spec(tmp_path, "{accelerators: [cpu:1, L4:1]}"), ALL_USABLE)
    assert p.offering.provider == "local" and p.chosen.usd_per_hour == 0.0


def test_count_nobody_sells_gets_a_row_saying_what_is_sold(tmp_path):
    s = spec(tmp_path, "{accelerators: [H200:1, H100:16, L4:1], clouds: [aws, gcp]}")
    p = plan(s, ALL_USABLE, fixed_predictor({"H200": 0.5, "H100": 0.5, "L4": 2.0}))
    rows = {(c.offering.accelerator, c.offering.count): c for c in p.candidates if c.offering.provider == "-"}
    assert rows[("H200", 1)].rejected.message == "H200 is sold as :8 only here; ask for H200:8"
    assert rows[("H100", 16)].rejected.message == ("H100 is sold as :1 and :2 and :4 and :8 here; "
                                                   "ask for H100:1 or H100:2 or H100:4 or H100:8")
    assert rows[("H100", 16)].rejected.code is FailureCode.NOT_SOLD
    assert rows[("H100", 16)].rejected.data["sold_counts"] == [1, 2, 4, 8]
    row = rows[("H200", 1)].to_dict()
    assert rows[("H200", 1)].usd_per_hour is None and row["rejected"] == "H200 is sold as :8 only here; ask for H200:8"
    assert row["rejected_code"] == "not_sold"
    assert p.offering.accelerator == "L4"  # the rows never win
    with pytest.raises(InfeasibleError) as e:
        plan(spec(tmp_path, "{accelerators: [H200:2]}"), ALL_USABLE, fixed_predictor({"H200": 0.5}))
    assert "H200 is sold as :8 only here; ask for H200:8" in e.value.message


def test_single_gpu_h100_offerings_are_sourced(tmp_path):
    from sftctl.catalog import cloud_offerings

    single = [o for o in cloud_offerings() if o.accelerator == "H100" and o.count == 1]
    assert {o.provider for o in single} == {"aws", "gcp"}
    assert all(o.source and o.as_of and o.usd_per_hour > 0 for o in single)
    p = plan(spec(tmp_path, "{accelerators: [H100:1]}"), ALL_USABLE, fixed_predictor({"H100": 0.5}))
    cheapest = min(single, key=lambda o: o.usd_per_hour)  # at the same speed, the cheapest
    assert (p.offering.instance_type, p.offering.region) == (cheapest.instance_type, cheapest.region)
    assert "p5.4xlarge" in {o.instance_type for o in single}


def test_missing_framework_names_the_extra_to_install(tmp_path):
    """A model whose framework is not installed: the hint names the pip extra, not --debug."""
    from sftctl.errors import SpecError
    from sftctl.planner import Predictor

    (tmp_path / "model.py").write_text(
        "def build(batch_size, dtype):\n"
        "    raise ModuleNotFoundError(\"No module named 'flax'\", name='flax')\n")
    s = load_spec(write_spec(tmp_path / "job.yaml", (
        "name: job\nmodel: {framework: jax, entrypoint: 'model.py:build', batch_size: 2}\n"
        "resources: {accelerators: [H100:8]}\nrun: echo\n")))
    with pytest.raises(SpecError) as e:
        Predictor(s).graph()
    assert "No module named 'flax'" in e.value.message
    assert e.value.hint.startswith("install it: pip install -e '.[jax]' in sftctl's clone"), e.value.hint


def test_a_cluster_whose_query_fails_names_its_reason_in_the_error(tmp_path, home):
    """A Slurm cluster reached over SSH that does not answer has no row to reject: its reason
    was lost ("no offering can run 2 node(s) of cpu:1 (1 x local is not in resources.clouds)")."""
    from slurm_cluster import free_ports

    [closed] = free_ports(1)  # nothing listens there
    spec = load_spec(write_spec(tmp_path / "job.yaml", (
        "name: t\nresources: {nodes: 2, accelerators: ['cpu:1'], clouds: [slurm]}\n"
        f"slurm: {{host: 127.0.0.1, port: {closed}}}\nrun: echo\n")))
    with pytest.raises(InfeasibleError) as e:
        plan(spec, usable={"local": None, "slurm": None})
    assert "no offering can run 2 node(s) of cpu:1" in e.value.message
    assert "slurm: ssh 127.0.0.1" in e.value.message, e.value.message


def test_ssh_control_sockets_fit_a_unix_socket_path_under_a_deep_home(tmp_path, monkeypatch):
    """A deep SFTCTL_HOME (an xdist worker's tmp_path) put ssh's ControlPath past the 108 bytes
    a unix socket holds: ssh failed and the cluster's offerings vanished from the plan."""
    from sftctl.providers.slurm import _SOCKET_PATH_MAX, SSHRunner
    from sftctl.slurm_config import SlurmConfig

    for home in (tmp_path / "h", tmp_path / ("deep" * 20) / "home"):
        monkeypatch.setenv("SFTCTL_HOME", str(home))
        path = SSHRunner(SlurmConfig(host="127.0.0.1")).control_path
        assert len(path) <= _SOCKET_PATH_MAX, path
        fits = len(str(home / "ssh" / "cm-000000000000")) <= _SOCKET_PATH_MAX
        assert Path(path).parent == (home / "ssh" if fits else Path(tempfile.gettempdir()) / f"sftctl-ssh-{os.getuid()}")
        assert Path(path).parent.stat().st_mode & 0o777 == 0o700


def test_no_credentials_hint_does_not_send_a_gpu_job_to_this_machine(tmp_path):
    """No cloud configured for a GPU job: the hint is the credentials, not `resources.clouds:
    [local]` (a new user followed that for examples/gpt2-small.yaml and was refused again)."""
    none = {"local": None, "aws": "aws credentials not found", "gcp": "gcp credentials not found",
            "kubernetes": "no kubeconfig"}
    gpu = spec(tmp_path, "{accelerators: [H100:8, T4:1], clouds: [aws, gcp]}")
    with pytest.raises(InfeasibleError) as e:
        plan(gpu, none, fixed_predictor({"H100": 0.1, "T4": 1.0}))
    assert e.value.hint == "set the credentials of a cloud (sftctl check says what each one needs)", e.value.hint


def test_one_split_of_the_global_batch_exact_or_as_the_launcher_rounds_it():
    """per_rank_batch is the one split: plan, compile and calibrate import need it exact; the
    launcher (controller/submit.py's SFTCTL_BATCH_SIZE) rounds an unchecked one down, never to 0."""
    from sftctl.planner import _Unsplittable, per_rank_batch

    assert per_rank_batch(32, 8, 2) == 2
    with pytest.raises(_Unsplittable, match="model.batch_size 33 does not split evenly over 2 data-parallel ranks"):
        per_rank_batch(33, 2, 1)
    assert [per_rank_batch(b, 2, 2, exact=False) for b in (8, 9, 3, 1)] == [2, 2, 1, 1]
