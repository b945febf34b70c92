"""How accelerators are recognized: the catalog's identity column (sftctl.catalog.identity), and
that adding an accelerator touches accelerators.yaml, offerings.csv and the data files of its
measured tables only."""

from __future__ import annotations

import csv
import dataclasses
import json
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
    die: sm_99_Z100
    gemm_table: sm_99_Z100
    gemm_model: sm_99_Z100
    gemm_tiles: cublas
    collective_link: nvlink-z100
    pcie_link: pcie-gen4
    calibration: h200.json
    peers: h200.json
    accuracy: null
    identity:
      cuda_names: [Z100]
      compute_capability: "9.9"
      identify_by_capability: true
      kubernetes_labels:
        nvidia.com/gpu.product: [NVIDIA-Z100]
        cloud.google.com/gke-accelerator: [nvidia-z100]
      gce_accelerator_type: nvidia-z100
      slurm_gres: [z100_96gb]
    sources: {sm_count: "made up for a test", die: "made up", gemm_table: "made up: half the H100's times",
              gemm_model: "made up",
              gemm_tiles: "made up", collective_link: "made up: 10 us + bytes / 1 TB/s", pcie_link: "made up",
              calibration: "made up", peers: "made up"}
"""
#: Z100's link in (a copy of) calibrations/collectives.json: one fit for every op and group size
Z100_LINK = {"kind": "in-host", "source": "made up for a test", "quote": "made up", "measured": False,
             "fits": [{"op": "*", "group_size": 0, "alpha_s": 1e-5, "bus_bytes_per_s": 1e12}]}


@pytest.fixture
def z100(tmp_path, monkeypatch):
    """A made-up accelerator added the way a new one is: an entry in (a copy of)
    accelerators.yaml, its rows in (a copy of) offerings.csv, its own GEMM table in (a copy of)
    XLA's matmul.json (the H100's rows at half the time) and its own link in (a copy of)
    collectives.json. No code changes: the copies stand in for the shipped files."""
    import sftctl.compiler.target as target
    from sftctl.compiler import accuracy, collectives, gemm_table, matmul_interpolator

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

    matmul = json.loads(matmul_interpolator.TABLE_PATH.read_text())
    h100 = matmul["tables"]["sm_90"]["bf16xbf16->bf16"]
    matmul["tables"]["sm_99_Z100"] = {"bf16xbf16->bf16": {
        "params": h100["params"], "rows": [r[:4] + [r[4] / 2] for r in h100["rows"]]}}
    matmul["measured_on"]["sm_99_Z100"] = "Z100"
    matmul_copy = tmp_path / "matmul.json"
    matmul_copy.write_text(json.dumps(matmul))
    links = json.loads(collectives.DATA.read_text())
    links["links"]["nvlink-z100"] = Z100_LINK
    links_copy = tmp_path / "collectives.json"
    links_copy.write_text(json.dumps(links))

    def clear():
        accelerators._document.cache_clear()
        accelerators.load_accelerators.cache_clear()
        catalog._cloud_offerings.cache_clear()
        target._load.cache_clear()
        matmul_interpolator.document.cache_clear()
        gemm_table._interp.cache_clear()
        collectives._load.cache_clear()
        collectives.link.cache_clear()
        accuracy.accuracy.cache_clear()

    monkeypatch.setattr(accelerators, "ACCELERATORS_YAML", yaml_copy)
    monkeypatch.setattr(catalog, "_CSV", csv_copy)
    monkeypatch.setattr(matmul_interpolator, "TABLE_PATH", matmul_copy)
    monkeypatch.setattr(collectives, "DATA", links_copy)
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
    from sftctl.providers import provider_class  # what a provider does is an interface, not a flag
    from sftctl.providers.base import QueueEstimate

    assert issubclass(provider_class("slurm"), QueueEstimate) and not issubclass(provider_class("aws"), QueueEstimate)
    assert "queue_estimate" not in {f.name for f in dataclasses.fields(slurm)}
    assert aws.boots_script and k8s.boots_script and not local.boots_script and not slurm.boots_script
    assert capabilities(None) == local  # a job recorded before it had a provider
    with pytest.raises(ValueError):
        capabilities("azure")
    for module in ("planner.py", "queue.py", "state"):  # state: a package
        path = CATALOG.parent / module
        text = "".join(p.read_text() for p in sorted(path.rglob("*.py"))) if path.is_dir() else path.read_text()
        assert '== "local"' not in text and 'provider == "slurm"' not in text, module


def test_a_new_accelerator_is_priced_through_its_own_gemm_table_and_link(z100, monkeypatch, capsys):
    """The done-when of issue 39 item 1: Z100's GEMMs are priced by its own measured table (at a
    grid point, the table's value: half the H100's) and its collectives by its own link, through
    the compiler's front (gemm_table, collectives, python -m sftctl.compiler.predict)."""
    import io
    import sys

    from sftctl.compiler import collectives, gemm_table, predict
    from sftctl.compiler.hardware import get_accelerator

    z, h100 = get_accelerator("Z100"), get_accelerator("H100")
    assert gemm_table.table_for("Z100", "bfloat16") == ("sm_99_Z100", "bf16xbf16->bf16")
    rows = gemm_table.tables()["sm_99_Z100"]["bf16xbf16->bf16"]["rows"]
    for b, m, n, k, t in rows[::29]:
        assert gemm_table.gemm_gpu_time_s(b, m, n, k, z, "bfloat16") == pytest.approx(t, rel=1e-9)
        assert gemm_table.gemm_gpu_time_s(b, m, n, k, h100, "bfloat16") == pytest.approx(2 * t, rel=1e-9)
    # between its grid points: its own neighbours, not the H100's scaled by the peaks
    mid = gemm_table.gemm_gpu_time_s(1, 2048, 2048, 3072, z, "bfloat16")
    lo, hi = (next(r[4] for r in rows if r[:4] == [1, 2048, 2048, k]) for k in (2048, 4096))
    assert lo < mid < hi
    # its collectives run over its own link: 10 us + bus bytes / 1 TB/s
    assert collectives.host_link("Z100").name == "nvlink-z100"
    for nbytes in (2**20, 2**30):
        want = 1e-5 + 2 * 7 / 8 * nbytes / 1e12
        assert collectives.time_s("all-reduce", nbytes, "Z100", 8) == pytest.approx(want, rel=1e-12)
    assert collectives.host_link("Z100", intra_node_bytes_per_s=25e9).name == "pcie-gen4"
    # the predict tool (records as XLA writes them) prices both the same way
    recs = [{"b": 1, "m": 4096, "n": 4096, "k": 4096, "dtype": "bf16xbf16->bf16"},
            {"opcode": "all-gather", "group_size": 8, "input_bytes_per_device": 2**27,
             "output_bytes_per_device": 2**30}]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in recs)))
    assert predict.main(["--target", "z100", "--no-compile"]) == 0
    out = [json.loads(line)["predicted_s"] for line in capsys.readouterr().out.splitlines()]
    assert out[0] == pytest.approx(next(r[4] for r in rows if r[:4] == [1, 4096, 4096, 4096]), rel=1e-9)
    assert out[1] == pytest.approx(1e-5 + 7 / 8 * 2**30 / 1e12, rel=1e-12)


def test_mi355x_is_in_the_catalog_but_not_sold():
    """MI355X is a catalog entry (its facts price XLA's gfx950 tables) that no offering sells: the
    planner says so and offers nothing."""
    from sftctl.errors import InfeasibleError
    from sftctl.planner import plan
    from sftctl.spec import JobSpec

    mi = accelerators.get_accelerator("MI355X")
    assert (mi.die, mi.gemm_table, mi.collective_link, mi.accuracy) == ("gfx950", "gfx950", "xgmi-mi355x", "mi355x.json")
    assert not [o for o in catalog.cloud_offerings() if o.accelerator == "MI355X"]
    spec = JobSpec.model_validate({"name": "m", "run": "echo", "resources": {"accelerators": ["MI355X:8"]}})
    with pytest.raises(InfeasibleError, match="sells MI355X"):
        plan(spec, {"aws": None, "gcp": None})


def test_for_device_is_the_one_device_lookup_with_one_default(monkeypatch):
    """Target.for_device: $SFTCTL_ACCELERATOR wins; a device that names no catalog accelerator (a
    CPU tensor in a forced run) gets target.DEVICE_DEFAULT; an unknown override is a KeyError
    naming the known ones."""
    import torch

    from sftctl.compiler import target

    monkeypatch.delenv("SFTCTL_ACCELERATOR", raising=False)
    assert target.Target.for_device(None).name == target.DEVICE_DEFAULT == "H100"
    assert target.Target.for_device(torch.device("cpu")) is target.load_target(target.DEVICE_DEFAULT)
    monkeypatch.setenv("SFTCTL_ACCELERATOR", "b200")
    assert target.Target.for_device(torch.device("cpu")).name == "B200"
    monkeypatch.setenv("SFTCTL_ACCELERATOR", "Z9")
    with pytest.raises(KeyError, match="unknown accelerator 'Z9'"):
        target.Target.for_device(None)


def test_the_compilers_code_names_no_accelerator():
    """Tables keyed by accelerator live in accelerators.yaml and the data files it names: no
    string in the compiler's modules is a catalog name, but the one device default, and where the
    one measured kernel set lives and was taken (records.py's data/h200/, the tools' defaults)."""
    import ast

    names = {n.lower() for n in accelerators.load_accelerators()} - {"cpu"}
    compiler = CATALOG.parent / "compiler"
    allowed = {("target.py", "H100"), ("accuracy_cv.py", "H200"), ("records.py", "h200"), ("calibration.py", "h200")}
    found = set()
    for path in compiler.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and node.value.lower() in names:
                found.add((path.name, node.value))
    assert found == allowed
