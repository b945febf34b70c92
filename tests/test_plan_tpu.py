"""TPU slices in the plan: a JAX model's step priced on TPU v5e and v6e by the TPU cost model
(sftctl/compiler/tpu.py), ranked with NVIDIA offerings by cost, each row with its interval from
the TPU accuracy files; a torch model is refused on a TPU with the reason. Also the TPU model
itself: its fit to the published MaxText figures and its leave-one-out accuracy."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import write_spec
from sftctl.catalog.accelerators import get_accelerator
from sftctl.compiler import accuracy, tpu
from sftctl.planner import plan
from sftctl.spec import load_spec
from sftctl.types import FailureCode

ROOT = Path(__file__).resolve().parents[1]
USABLE = {"local": None, "aws": None, "gcp": None, "kubernetes": "no kubeconfig", "slurm": "no slurm"}


def test_a_jax_model_is_ranked_on_tpus_beside_gpus(tmp_path):
    spec = load_spec(write_spec(tmp_path / "job.yaml", (
        f"name: j\nworkdir: {ROOT}\n"
        "model: {framework: jax, entrypoint: 'examples/jax_mlp/model.py:build', batch_size: 64, dtype: bfloat16}\n"
        "train: {steps: 1000}\n"
        "resources: {accelerators: ['TPU-v5e:8', 'TPU-v6e:8', 'A100-80GB:1'], clouds: [gcp]}\nrun: echo\n")))
    p = plan(spec, usable=USABLE)
    tpus = [c for c in p.candidates if c.offering.accelerator.startswith("TPU")]
    assert {(c.offering.accelerator, c.offering.instance_type) for c in tpus} == {
        ("TPU-v5e", "v5litepod-8"), ("TPU-v6e", "v6e-8")}
    for c in tpus:
        assert c.rejected is None and c.step_time_s > 0 and c.parallelism in ("ddp", "fsdp")
        f = accuracy.accuracy(c.offering.accelerator)["error"]
        lo, hi = c.step_time_interval_s
        assert lo == pytest.approx(c.step_time_s / f, rel=1e-6) and hi == pytest.approx(c.step_time_s * f, rel=1e-6)
        assert c.calibration["calibrated"] is True
    # the same step is faster on the v6e (4.7x the v5e's bf16 peak, 2x its HBM bandwidth)
    step = {c.offering.accelerator: c.step_time_s for c in tpus}
    assert step["TPU-v6e"] < step["TPU-v5e"]
    gpus = [c for c in p.candidates if c.offering.accelerator == "A100-80GB" and c.rejected is None]
    assert gpus and all(c.step_time_s > 0 for c in gpus)
    ranked = [c for c in p.candidates if c.rejected is None]
    assert [c.total_usd for c in ranked] == sorted(c.total_usd for c in ranked)  # one ranking for all


def test_a_torch_model_is_refused_on_a_tpu_with_the_reason(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "def build(batch_size, dtype):\n"
        "    model = torch.nn.Linear(8, 8)\n"
        "    return model, (torch.randn(batch_size, 8),), lambda out: out.sum()\n")
    spec = load_spec(write_spec(tmp_path / "job.yaml", (
        "name: t\nmodel: {framework: torch, entrypoint: 'm.py:build', batch_size: 8}\n"
        "resources: {accelerators: ['TPU-v5e:8', 'cpu:1'], clouds: [gcp, local]}\nrun: echo\n")))
    p = plan(spec, usable=USABLE, predict=lambda o, n: None)
    [row] = [c for c in p.candidates if c.offering.accelerator == "TPU-v5e"][:1]
    assert row.rejected.code == FailureCode.UNSUPPORTED
    assert "needs PyTorch/XLA" in row.rejected.message and "model.framework: jax" in row.rejected.message


def test_the_tpu_model_against_the_published_figures():
    """Each published MaxText figure predicted by the shipped fit within the accuracy file's
    factor; the fit is what `python -m sftctl.compiler.tpu --write` stored (refitting gives it)."""
    accs = {n: get_accelerator(n) for n in ("TPU-v5e", "TPU-v5p", "TPU-v6e")}
    entries = tpu._published("tpu.json")
    assert len(entries) >= 12 and {e["accelerator"] for e in entries} == set(accs)
    shipped, _ = tpu.model_of(accs["TPU-v5e"])
    assert tpu.fit(entries, accs) == shipped
    for e in entries:
        got = tpu.predict_published(e, accs[e["accelerator"]])
        f = accuracy.accuracy(e["accelerator"])["error"]
        assert 1 / f <= 1 / got["ratio"] <= f, (e["label"], got)
    # the published peaks are the MFU denominators: 197, 459, 918 TFLOP/s
    assert [accs[n].matrix_peak("bfloat16") for n in accs] == [1.97e14, 4.59e14, 9.18e14]


def test_mxu_padding_and_collectives():
    from sftctl.compiler.problem import GemmProblem

    assert tpu.gemm_fill(GemmProblem(1, 256, 256, 256, "bfloat16", "bfloat16"), 128) == 1.0
    assert tpu.gemm_fill(GemmProblem(1, 129, 128, 128, "bfloat16", "bfloat16"), 128) == pytest.approx(129 / 256)
    c = tpu.TPUCoefficients(ici_efficiency=1.0)
    # ring all-reduce: 2 (n-1)/n x bytes / bandwidth
    assert tpu.collective_s("all_reduce", 8e9, 8, 1e11, c) == pytest.approx(2 * 7 / 8 * 8e9 / 1e11)
    assert tpu.collective_s("all_gather", 8e9, 1, 1e11, c) == 0.0


FLAX_LM = """
import jax, jax.numpy as jnp
from flax import linen as nn


class LM(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(256, 512)(x)
        for _ in range(2):
            h = h + nn.Dense(512)(nn.gelu(nn.Dense(2048)(nn.LayerNorm()(h))))
        return nn.Dense(256)(nn.LayerNorm()(h))


def build(batch_size, dtype):
    model = LM()
    x = jnp.zeros((batch_size, 128), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)

    def loss_fn(params, batch):
        x, y = batch
        logp = jax.nn.log_softmax(model.apply(params, x), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

    return params, (x, x), loss_fn
"""


def test_a_flax_model_on_tpu_v5e_and_v6e_slices(tmp_path):
    """A flax.linen language model's plan on GCP: TPU v5e and v6e slices (8 and 16 chips) with
    step times and intervals, the step per chip faster on the v6e."""
    (tmp_path / "lm.py").write_text(FLAX_LM)
    spec = load_spec(write_spec(tmp_path / "job.yaml", (
        f"name: f\nworkdir: {tmp_path}\n"
        "model: {framework: jax, entrypoint: 'lm.py:build', batch_size: 64, dtype: bfloat16}\n"
        "train: {steps: 1000}\n"
        "resources: {accelerators: ['TPU-v5e:8', 'TPU-v6e:8', 'TPU-v5e:16', 'TPU-v6e:16'], clouds: [gcp]}\n"
        "run: echo\n")))
    p = plan(spec, usable=USABLE)
    rows = {(c.offering.accelerator, c.offering.count): c for c in p.candidates if c.rejected is None}
    assert set(rows) == {("TPU-v5e", 8), ("TPU-v6e", 8), ("TPU-v5e", 16), ("TPU-v6e", 16)}
    for c in rows.values():
        lo, hi = c.step_time_interval_s
        assert 0 < lo < c.step_time_s < hi and c.calibration["calibrated"]
    assert rows["TPU-v6e", 8].step_time_s < rows["TPU-v5e", 8].step_time_s
    # 16 chips: half the batch per chip, plus the gradient all-reduce over ICI
    assert rows["TPU-v5e", 16].step_time_s < rows["TPU-v5e", 8].step_time_s
    assert rows["TPU-v5e", 16].strategies[0]["comm_time_s"] >= 0


def test_tpu_amd_and_nvidia_offerings_are_ranked_together(tmp_path, monkeypatch):
    """A lab's Kubernetes node with 8 x MI300X (AMD's node labeller, amd.com/gpu), GCP's TPU
    v5e slices and NVIDIA GPUs: one plan prices the same JAX step on each and ranks them by cost."""
    from k8s_emulator import K8sEmulator, gpu_node

    amd = {"amd.com/gpu.product-name": "AMD_Instinct_MI300X_OAM"}
    with K8sEmulator(nodes=[gpu_node("mi300x-1", amd, 8, "amd.com/gpu")]) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path / "kc", context="lab")))
        for var in ("SFTCTL_K8S_CONTEXT", "SFTCTL_K8S_NAMESPACE", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(var, raising=False)
        spec = load_spec(write_spec(tmp_path / "job.yaml", (
            f"name: j\nworkdir: {ROOT}\n"
            "model: {framework: jax, entrypoint: 'examples/jax_mlp/model.py:build', batch_size: 64, dtype: bfloat16}\n"
            "train: {steps: 1000}\n"
            "resources: {accelerators: ['TPU-v5e:8', 'MI300X:8', 'H100:8'], clouds: [gcp, kubernetes]}\nrun: echo\n")))
        p = plan(spec, usable={**USABLE, "kubernetes": None})
    feasible = [c for c in p.candidates if c.rejected is None]
    vendors = {get_accelerator(c.offering.accelerator).vendor for c in feasible}
    assert vendors == {"google", "amd", "nvidia"}
    (mi,) = [c for c in feasible if c.offering.accelerator == "MI300X"]
    assert mi.offering.provider == "kubernetes" and mi.offering.instance_type == "AMD_Instinct_MI300X_OAM"
    assert all(c.step_time_s > 0 and c.step_time_interval_s for c in feasible)
    assert [c.total_usd for c in feasible] == sorted(c.total_usd for c in feasible)
    assert p.chosen.offering.accelerator == "MI300X"  # the lab's own node is unpriced (0 $/h): cheapest


def test_a_gcp_refresh_keeps_the_tpu_slices_it_does_not_read(home):
    """`catalog refresh` reads Compute Engine's machine and GPU prices, not Cloud TPU's: a refresh
    that covered us-central1 drops GCE types it did not find there, never the TPU slices."""
    from sftctl import catalog

    before = {(o.instance_type, o.region) for o in catalog.cloud_offerings() if o.provider == "gcp"}
    assert ("v5litepod-8", "us-central1") in before and ("g2-standard-4", "us-central1") in before
    row = {c: "" for c in catalog.COLUMNS} | {
        "provider": "gcp", "instance_type": "a2-highgpu-1g", "accelerator": "A100-40GB", "count": "1",
        "vcpus": "12", "memory_gib": "85", "region": "us-central1", "usd_per_hour": "3.5", "as_of": "2026-12-01",
        "source": "refresh"}
    catalog.write_refreshed([row], {"gcp": ["us-central1"]})
    after = {(o.instance_type, o.region) for o in catalog.cloud_offerings() if o.provider == "gcp"}
    assert ("g2-standard-4", "us-central1") not in after  # the refresh is the truth for GCE there
    assert {("v5litepod-8", "us-central1"), ("v5litepod-16", "us-central1")} <= after
