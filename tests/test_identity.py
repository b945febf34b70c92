"""How accelerators are recognized: the catalog's identity column (sftctl.catalog.identity), and
that adding an accelerator touches accelerators.yaml and offerings.csv only."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest

from sftctl import catalog
from sftctl.catalog import accelerators
from sftctl.catalog.identity import calibrated_from, from_slurm_gres, identify

CATALOG = Path(catalog.__file__).resolve().parent


@pytest.mark.parametrize("name,memory,cap,want", [
    ("NVIDIA H200", None, None, "H200"),
    ("NVIDIA H100 80GB HBM3", None, None, "H100"),
    ("NVIDIA A100-SXM4-40GB", None, None, "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", None, None, "A100-80GB"),
    ("NVIDIA A100 PCIe", 40 * 2**30, None, "A100-40GB"),
    ("NVIDIA L4", None, None, "L4"),
    ("NVIDIA L40S", None, None, None),  # not an L4
    ("NVIDIA A10G", None, None, "A10G"),
    ("Tesla T4", None, None, "T4"),
    ("Tesla V100-SXM2-16GB", None, None, "V100"),
    ("AMD Instinct MI300X", None, None, "MI300X"),
    ("NVIDIA GH200 480GB", None, (9, 0), "H100"),  # not an H200: by its compute capability
    ("Some Future GPU", None, None, None),
])
def test_identify_a_device(name, memory, cap, want):
    acc = identify(name=name, memory_bytes=memory, capability=cap)
    assert (acc.name if acc else None) == want


def test_identify_takes_torch_device_properties():
    @dataclasses.dataclass
    class Props:  # the fields torch.cuda.get_device_properties(i) has
        name: str
        total_memory: int
        major: int
        minor: int

    assert identify(Props("NVIDIA A100-PCIE", 80 * 2**30, 8, 0)).name == "A100-80GB"
    assert identify(Props("NVIDIA RTX 6000 Ada", 48 * 2**30, 8, 9)).name == "L4"  # same capability
    assert catalog.identify("NVIDIA H200").name == "H200"


def test_slurm_types_and_calibration_source():
    assert (from_slurm_gres("h100"), from_slurm_gres("a100_80gb"), from_slurm_gres("mi300")) == ("H100", "A100-80GB", "MI300X")
    assert from_slurm_gres("mystery") == ""
    assert calibrated_from("H100") == "H200" and calibrated_from("A100-80GB") is None


Z100 = """
  - name: Z100
    vendor: nvidia
    sm_count: 144
    clock_hz: 2.0e+9
    matrix_flops_per_s: {float32: 5.0e+14, tfloat32: 5.0e+14, bfloat16: 1.0e+15, float16: 1.0e+15}
    vector_flops_per_s: {float32: 7.0e+13, bfloat16: 1.4e+14, float16: 1.4e+14}
    hbm_bytes_per_s: 6.0e+12
    l2_bytes: 67108864
    smem_bytes_per_sm: 233472
    smem_bytes_per_block: 232448
    regs_per_sm: 65536
    regs_per_thread_max: 255
    max_warps_per_sm: 64
    max_blocks_per_sm: 32
    warp_size: 32
    memory_bytes: 103079215104
    memory_latency_s: 5.0e-7
    launch_overhead_s: 5.0e-6
    triton_backend: cuda
    triton_arch: 90
    identity:
      cuda_names: [Z100]
      compute_capability: "9.9"
      identify_by_capability: true
      kubernetes_labels:
        nvidia.com/gpu.product: [NVIDIA-Z100]
        cloud.google.com/gke-accelerator: [nvidia-z100]
      gce_accelerator_type: nvidia-z100
      slurm_gres: [z100_96gb]
      calibrated_from: H200
    sources: {sm_count: "made up for a test"}
"""


@pytest.fixture
def z100(tmp_path, monkeypatch):
    """A made-up accelerator added the way a new one is: an entry in (a copy of)
    accelerators.yaml and its rows in (a copy of) offerings.csv. Nothing else changes."""
    import sftctl.compiler.target as target

    yaml_copy = tmp_path / "accelerators.yaml"
    yaml_copy.write_text((CATALOG / "accelerators.yaml").read_text().rstrip() + "\n" + Z100)
    csv_copy = tmp_path / "offerings.csv"
    rows = list(csv.DictReader((CATALOG / "offerings.csv").open(newline="")))
    extra = [dict(rows[0], provider=p, instance_type=t, accelerator="Z100", count="8", region=r,
                  usd_per_hour="9.99", spot_usd_per_hour="", source="made up for a test")
             for p, t, r in (("aws", "z5.48xlarge", "us-east-1"), ("gcp", "n1-standard-96+Z100", "us-central1"))]
    with csv_copy.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows + extra)

    def clear():
        accelerators._entries.cache_clear()
        accelerators.load_accelerators.cache_clear()
        catalog._cloud_offerings.cache_clear()
        target._load.cache_clear()

    monkeypatch.setattr(accelerators, "ACCELERATORS_YAML", yaml_copy)
    monkeypatch.setattr(catalog, "_CSV", csv_copy)
    clear()
    yield
    monkeypatch.undo()
    clear()


def test_a_new_accelerator_is_one_yaml_entry_and_its_offerings(z100):
    from sftctl.compiler.target import load_target
    from sftctl.planner import plan
    from sftctl.providers.gcp import catalog_instance_type, split_instance_type
    from sftctl.providers.kubernetes import node_accelerator, node_selector_terms
    from sftctl.providers.slurm import accelerator_of
    from sftctl.spec import JobSpec

    # a device, by name or by compute capability
    assert identify(name="NVIDIA Z100 96GB").name == "Z100"
    assert identify(name="NVIDIA Z100-Next", capability=(9, 9)).name == "Z100"
    # Kubernetes: a node's labels, and the selector for the accelerator
    node = {"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-Z100"}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}
    assert node_accelerator(node) == ("Z100", "NVIDIA-Z100", 8)
    assert [("nvidia.com/gpu.product", ["NVIDIA-Z100"])] in node_selector_terms("Z100")
    # GCE's accelerator type, both ways; a Slurm GPU type
    assert split_instance_type("n1-standard-96+Z100", "Z100", 8) == ("n1-standard-96", ("nvidia-z100", 8))
    assert catalog_instance_type("zones/us-central1-a/machineTypes/n1-standard-96", [("nvidia-z100", 8)]) == \
        "n1-standard-96+Z100"
    assert accelerator_of("z100_96gb") == "Z100"
    # the compiler: its own facts, the calibration of the accelerator it names
    t = load_target("Z100")
    assert t.hw.hbm_bytes_per_s == 6.0e12 and t.coeffs == load_target("H200").coeffs
    assert "Z100" in catalog.accelerator_names()
    # the planner sells it from offerings.csv
    spec = JobSpec.model_validate({"name": "z", "run": "echo", "resources": {"accelerators": ["Z100:8"]}})
    p = plan(spec, {"aws": None, "gcp": None})
    assert {c.offering.instance_type for c in p.candidates} == {"z5.48xlarge", "n1-standard-96+Z100"}
    assert p.offering.accelerator == "Z100" and p.chosen.usd_per_hour == 9.99


def test_provider_capabilities_are_declared_not_compared_by_name():
    """What the planner, the queue, state and the controller decide by is declared on each
    provider's handle class (types.ProviderCapabilities)."""
    from sftctl.types import capabilities

    local, slurm, aws, k8s = (capabilities(p) for p in ("local", "slurm", "aws", "kubernetes"))
    assert local.local_admission and local.shares_filesystem and not local.needs_job_storage
    assert not local.regional and not slurm.regional and aws.regional and k8s.regional
    assert slurm.queue_estimate and not aws.queue_estimate
    assert aws.boots_script and k8s.boots_script and not local.boots_script and not slurm.boots_script
    assert capabilities(None) == local  # a job recorded before it had a provider
    with pytest.raises(ValueError):
        capabilities("azure")
    for module in ("planner.py", "queue.py", "state.py"):
        text = (CATALOG.parent / module).read_text()
        assert '== "local"' not in text and 'provider == "slurm"' not in text, module
