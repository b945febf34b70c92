"""Job storage (sftctl.storage) against real servers: a local directory, S3 on moto's server and
GCS on gcp-storage-emulator, both over HTTP on loopback ports started by the session fixtures."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftctl.errors import ExitCode, ProviderError, SpecError
from sftctl.storage import (
    MARKER_KEY,
    BucketNotFoundError,
    LocalStorage,
    StorageAccessDenied,
    StorageError,
    StorageNotFound,
    open_storage,
)
from sftctl.providers.cloud import CloudProvider, InstanceState
from sftctl.storage import checkpoints as ck
from sftctl.protocol import is_secret_name
from sftctl.storage.stream import NodeChannel
from sftctl.storage.stream import Shipper, StreamReader, StreamWriter
from sftctl.storage.workdir import WorkdirTooLargeError, fetch_workdir, list_workdir, pack_workdir, upload_workdir
from sftctl.types import CloudHandle

REPO = Path(__file__).resolve().parents[1]
SECRET = "testing-secret"  # the AWS secret key every test here sets; no object may contain it
BACKENDS = ["local", "s3", "gcs"]


def _bucket() -> str:
    return f"sftctl-test-{uuid.uuid4().hex[:12]}"


def _make_storage(kind: str, request, tmp_path: Path, monkeypatch, create: bool = True):
    """A fresh, empty storage of ``kind``; the bucket is created outside sftctl when ``create``."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    if kind == "local":
        root = tmp_path / "store"
        if create:
            root.mkdir(parents=True)
        return open_storage(f"file://{root}/")
    bucket = _bucket()
    if kind == "s3":
        request.getfixturevalue("aws")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # after aws set its fake one
        if create:
            import boto3

            boto3.client("s3").create_bucket(Bucket=bucket)
        return open_storage(f"s3://{bucket}/jobs/job-1")
    from servers import gcs_env

    for key, value in gcs_env(request.getfixturevalue("gcs_endpoint")).items():
        monkeypatch.setenv(key, value)
    if create:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage as gcs

        gcs.Client(project="sftctl-test", credentials=AnonymousCredentials()).create_bucket(bucket)
    return open_storage(f"gs://{bucket}/jobs/job-1")


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path, monkeypatch):
    """An empty storage whose bucket exists (created outside sftctl), ``ensure``d."""
    s = _make_storage(request.param, request, tmp_path, monkeypatch)
    s.ensure()
    return s


def _all_objects(store) -> dict[str, bytes]:
    return {key: store.get_bytes(key) for key, _ in store.list("")}


# ------------------------------------------------------------------------------------ URLs


def test_open_storage_urls(tmp_path, monkeypatch):
    assert open_storage(str(tmp_path)).root == tmp_path
    assert open_storage(f"file://{tmp_path}/a/").url == f"file://{tmp_path}/a"
    monkeypatch.setenv("SFTCTL_PVC_MOUNT", str(tmp_path / "mnt"))
    pvc = open_storage("pvc://claim-1/jobs/j1")
    assert isinstance(pvc, LocalStorage) and pvc.root == tmp_path / "mnt" / "jobs" / "j1"
    assert pvc.url == "pvc://claim-1/jobs/j1"
    with pytest.raises(BucketNotFoundError, match="volume mount") as e:
        pvc.ensure(create_bucket=True)  # a volume cannot be created from a pod
    assert "SFTCTL_PVC_MOUNT" in e.value.hint
    (tmp_path / "mnt").mkdir()
    assert pvc.ensure()["created_bucket"] is False
    assert (tmp_path / "mnt" / "jobs" / "j1" / MARKER_KEY).is_file()
    for bad in ("ftp://x/y", "s3://", "gs:///p", "file://relative", "s3://b/a/../c", ""):
        with pytest.raises(StorageError) as e:
            open_storage(bad)
        assert e.value.exit_code == ExitCode.PROVIDER and "\n" not in e.value.message and e.value.hint


def test_import_is_light():
    code = ("import sys, sftctl.storage, sftctl.storage.checkpoints, sftctl.storage.stream, "
            "sftctl.protocol, sftctl.storage.workdir, sftctl.train\n"
            "bad = [m for m in ('boto3', 'botocore', 'google.cloud.storage', 'torch') if m in sys.modules]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ------------------------------------------------------------------------------------ objects


def test_objects(store):
    store.put_bytes("a/b/c.txt", b"hello")
    store.put_bytes("a/d", b"xy")
    store.put_bytes("a/b/c.txt", b"hello world")  # replaced
    store.put_bytes("z", b"")
    assert store.get_bytes("a/b/c.txt") == b"hello world"
    assert store.get_bytes("a/b/c.txt", 6) == b"world" and store.get_bytes("a/d", 2) == b""
    assert store.list("a/") == [("a/b/c.txt", 11), ("a/d", 2)]
    assert store.list("a/b") == [("a/b/c.txt", 11)]
    assert store.list("a/", start_after="a/b/c.txt") == [("a/d", 2)]
    assert [k for k, _ in store.list("")] == [MARKER_KEY, "a/b/c.txt", "a/d", "z"]
    assert store.children("a/") == ["b", "d"] and store.children("nothing/") == []
    assert store.exists("a/d") and not store.exists("a/e") and store.size("z") == 0 and store.size("q") is None
    with pytest.raises(StorageNotFound) as e:
        store.get_bytes("a/missing")
    assert e.value.key == "a/missing" and store.url in e.value.message
    store.delete("a/d")
    store.delete("a/d")  # a missing object is fine
    assert store.list("a/") == [("a/b/c.txt", 11)]
    assert store.delete_prefix("a/") == 1 and store.list("a/") == []
    for bad in ("/abs", "a//b", "a/../b", "", "a/"):
        with pytest.raises(ValueError):
            store.put_bytes(bad, b"x")


def test_big_file_transfers_in_parts(store, tmp_path, monkeypatch):
    # 5 MiB parts (S3's minimum) so a 13 MiB file goes up and down in several parts / chunks
    import sftctl.storage as base

    for mod in [base] + [sys.modules[m] for m in ("sftctl.storage.s3", "sftctl.storage.gcs") if m in sys.modules]:
        monkeypatch.setattr(mod, "MULTIPART_THRESHOLD_BYTES", 5 * 1024 * 1024, raising=False)
        monkeypatch.setattr(mod, "MULTIPART_CHUNK_BYTES", 5 * 1024 * 1024, raising=False)
    if hasattr(store, "transfer"):
        from boto3.s3.transfer import TransferConfig

        store.transfer = TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024)
    data = random.Random(1).randbytes(13 * 1024 * 1024 + 17)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    store.upload_file("blobs/big.bin", src)
    assert store.size("blobs/big.bin") == len(data)
    dest = tmp_path / "out" / "big.bin"
    store.download_file("blobs/big.bin", dest)
    assert dest.read_bytes() == data
    assert not [p for p in dest.parent.iterdir() if p.name != "big.bin"]  # no temporary left
    with pytest.raises(StorageNotFound):
        store.download_file("blobs/none", tmp_path / "none")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("kind", BACKENDS)
def test_ensure_creates_only_when_asked_and_purge_spares_foreign_data(kind, request, tmp_path, monkeypatch):
    s = _make_storage(kind, request, tmp_path, monkeypatch, create=False)
    with pytest.raises(BucketNotFoundError) as e:
        s.ensure()
    assert s.url in e.value.message and "does not exist" in e.value.message and e.value.hint
    assert isinstance(e.value, ProviderError) and "\n" not in e.value.message
    assert s.ensure(create_bucket=True)["created_bucket"] is True
    assert s.ensure(create_bucket=True)["created_bucket"] is True  # the marker is kept as it is
    s.put_bytes("checkpoints/step-00000001/x", b"1")
    s.put_bytes("nodes/n/exit-1", b"0\n")
    assert s.purge() == 3
    assert not s._bucket_exists()  # sftctl created it and it is empty: gone

    # a bucket sftctl did not create, holding someone's data
    s = _make_storage(kind, request, tmp_path / "2", monkeypatch, create=True)
    with pytest.raises(StorageError, match="not deleting anything"):
        s.purge()  # no marker: refuses
    s.put_bytes("theirs/data.csv", b"precious")
    assert s.ensure(create_bucket=True)["created_bucket"] is False
    s.put_bytes("workdir/abc.tar.gz", b"x")
    s.purge()
    assert [k for k, _ in s.list("")] == ["theirs/data.csv"] and s._bucket_exists()


def test_s3_access_denied_is_one_line_without_secrets(monkeypatch):
    from servers import aws_env, free_port, server

    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with server(argv, port, env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as url:  # moto checks IAM
        for key, value in aws_env(url).items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        s = open_storage("s3://denied-bucket/p")
        for op in (lambda: s.ensure(create_bucket=True), lambda: s.get_bytes("k"), lambda: s.put_bytes("k", b"")):
            with pytest.raises(StorageAccessDenied) as e:
                op()
            assert e.value.exit_code == ExitCode.PROVIDER and "s3://denied-bucket/p" in e.value.message
            text = e.value.message + e.value.hint
            assert "\n" not in text and SECRET not in text and "AWS_SECRET_ACCESS_KEY" in e.value.hint
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")  # now nothing listens there
    with pytest.raises(StorageError, match="cannot reach"):
        open_storage("s3://gone-bucket/p").ensure()


# ------------------------------------------------------------------------------------ workdir


def _tree(root: Path, files: dict[str, bytes | str]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
    return root


def test_workdir_pack_honours_ignores(tmp_path):
    root = _tree(tmp_path / "wd", {
        ".gitignore": "*.log\nbuild/\n/data/\n!keep.log\n",
        ".sftctlignore": "*.ckpt\n!data/\n",
        "train.py": "print(1)\n",
        "run.log": "x", "keep.log": "k",
        "build/out.o": "o",
        "data/small.csv": "1,2\n",
        "model.ckpt": "c",
        "sub/.gitignore": "local.txt\n!*.log\n",
        "sub/local.txt": "l", "sub/deep.log": "d", "sub/mod.py": "m",
        "sub/build/x": "x",
        ".git/HEAD": "ref", "sub/.git": "gitdir: elsewhere",
        ".venv/bin/python": "#!", ".sftctlignore2": "",
    })
    (root / ".sftctlignore").write_text("*.ckpt\n!data/\n.venv/\n")
    got = [rel for rel, _, _ in list_workdir(root)]
    assert got == [".gitignore", ".sftctlignore", ".sftctlignore2", "data/small.csv", "keep.log",
                   "sub/.gitignore", "sub/deep.log", "sub/mod.py", "train.py"]


def test_workdir_deterministic_and_uploaded_once(store, tmp_path):
    files = {"train.py": "import os\n", "lib/util.py": "X = 1\n", "run.sh": "#!/bin/sh\necho hi\n",
             ".gitignore": "out/\n", "out/big.bin": b"\0" * 1000}
    a = _tree(tmp_path / "a", files)
    (a / "run.sh").chmod(0o755)
    (a / "lib" / "link.py").symlink_to("util.py")
    b = _tree(tmp_path / "b", files)  # same content, other mtimes, other place
    (b / "run.sh").chmod(0o755)
    (b / "lib" / "link.py").symlink_to("util.py")
    os.utime(b / "train.py", (1, 1))
    pa, pb = pack_workdir(a), pack_workdir(b)
    assert pa.data == pb.data and pa.key == f"workdir/{pa.sha256}.tar.gz" and pa.files == 5
    with tarfile.open(fileobj=io.BytesIO(pa.data)) as tar:
        assert [(m.name, m.mtime, m.uid, m.uname) for m in tar][:2] == [(".gitignore", 0, 0, ""), ("lib/link.py", 0, 0, "")]

    first = upload_workdir(store, a)
    assert first.uploaded and store.exists(first.key)
    before = store.list("")
    again = upload_workdir(store, b)  # unchanged: nothing is sent
    assert not again.uploaded and again.key == first.key and store.list("") == before
    (b / "train.py").write_text("import sys\n")
    changed = upload_workdir(store, b)
    assert changed.uploaded and changed.key != first.key

    dest = fetch_workdir(store, first.key, tmp_path / "node" / "wd")
    assert (dest / "lib" / "util.py").read_text() == "X = 1\n" and not (dest / "out").exists()
    assert os.access(dest / "run.sh", os.X_OK) and (dest / "lib" / "link.py").resolve() == dest / "lib" / "util.py"
    fetch_workdir(store, changed.key, dest)  # over an earlier fetch
    assert (dest / "train.py").read_text() == "import sys\n"
    store.put_bytes(first.key, changed.data)  # a corrupt archive is refused
    with pytest.raises(StorageError, match="corrupt"):
        fetch_workdir(store, first.key, tmp_path / "x")


def test_workdir_size_limit_names_biggest_files(tmp_path):
    root = _tree(tmp_path / "wd", {"a.bin": b"a" * 600, "data/b.bin": b"b" * 300, "c.py": "x" * 50})
    with pytest.raises(WorkdirTooLargeError) as e:
        pack_workdir(root, max_bytes=500)
    err = e.value
    assert isinstance(err, SpecError) and err.exit_code == ExitCode.USAGE
    assert err.message.index("a.bin") < err.message.index("data/b.bin") and ".sftctlignore" in err.hint
    assert err.biggest[0] == ("a.bin", 600)
    (root / ".sftctlignore").write_text("*.bin\n")
    assert pack_workdir(root, max_bytes=500).files == 2
    (root / "escape").symlink_to("/etc/passwd")
    with pytest.raises(SpecError, match="outside the workdir"):
        pack_workdir(root)


# ------------------------------------------------------------------------------------ checkpoints


def test_checkpoints_write_resume_keep(store, tmp_path):
    assert ck.latest_complete(store) is None and ck.complete_steps(store) == []
    src = _tree(tmp_path / "ck", {"state.pt": b"s" * 1000, "shards/rank-1.pt": b"r1"})
    m = ck.write_checkpoint(store, 10, src, keep=2)
    assert [f.name for f in m.files] == ["shards/rank-1.pt", "state.pt"] and m.size_bytes == 1002
    ck.write_checkpoint(store, 20, {"state.pt": b"twenty", "extra": src / "state.pt"}, keep=2)
    assert ck.complete_steps(store) == [10, 20] and ck.latest_complete(store) == 20
    ck.write_checkpoint(store, 30, {"state.pt": b"thirty"}, keep=2)
    assert ck.complete_steps(store) == [20, 30]
    assert not store.list(ck.step_prefix(10))  # older ones are deleted, data and manifest
    assert ck.read_file(store, 30, "state.pt") == b"thirty"
    got = ck.download_checkpoint(store, 20, tmp_path / "dl")
    assert (tmp_path / "dl" / "extra").read_bytes() == b"s" * 1000 and got.step == 20
    manifest = json.loads(store.get_bytes(ck.step_prefix(30) + ck.MANIFEST))
    assert manifest["files"] == [{"name": "state.pt", "size": 6, "sha256": hashlib.sha256(b"thirty").hexdigest()}]

    # torn checkpoints are never picked: a missing object, a wrong size, no manifest
    ck.write_checkpoint(store, 40, {"state.pt": b"forty", "opt.pt": b"o"}, keep=None)
    store.delete(ck.step_prefix(40) + "opt.pt")
    assert ck.latest_complete(store) == 30
    store.put_bytes(ck.step_prefix(40) + "opt.pt", b"oo")
    assert ck.latest_complete(store) == 30
    store.put_bytes(ck.step_prefix(50) + "state.pt", b"no manifest yet")
    assert ck.latest_complete(store) == 30 and ck.complete_steps(store) == [20, 30]
    store.put_bytes(ck.step_prefix(30) + "state.pt", b"THIRTY")  # same size, other bytes
    with pytest.raises(StorageError, match="sha256"):
        ck.read_file(store, 30, "state.pt")
    with pytest.raises(StorageNotFound):
        ck.download_checkpoint(store, 40, tmp_path / "torn")
    # rewriting a step replaces it whole; pruning removes torn ones older than the newest
    ck.write_checkpoint(store, 50, {"state.pt": b"fifty"}, keep=2)
    assert ck.complete_steps(store) == [30, 50] and not store.list(ck.step_prefix(40))
    assert [k for k, _ in store.list(ck.step_prefix(50))] == [ck.step_prefix(50) + n for n in (ck.MANIFEST, "state.pt")]


_INTERRUPTED_WRITER = r"""
import os, sys, time
from sftctl.storage import open_storage
from sftctl.providers.cloud import CloudProvider, InstanceState
from sftctl.storage import checkpoints as ck

store = open_storage(sys.argv[1])
where = sys.argv[2]
ck.write_checkpoint(store, 100, {"state.pt": b"complete-100"}, keep=3)
files = {f"part-{i}.bin": os.urandom(6 * 1024 * 1024) for i in range(4)}  # a 24 MB checkpoint

real_put = store.put_bytes
def put(key, data):
    if key.endswith("MANIFEST.json") and "step-00000200" in key:
        print("MANIFEST-NEXT", flush=True)  # every data object is up; the manifest is next
        time.sleep(600)
    if where == "data" and "part-2" in key:
        print("MID-DATA", flush=True)  # two parts are up, this one is being written
    return real_put(key, data)
store.put_bytes = put
ck.write_checkpoint(store, 200, files, keep=3, workers=1)
print("DONE", flush=True)
"""


@pytest.mark.parametrize("where", ["manifest", "data"])
def test_checkpoint_interrupted_mid_write_is_ignored(store, where, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_WRITER, store.url, where], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line == ("MANIFEST-NEXT" if where == "manifest" else "MID-DATA"), line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert store.list(ck.step_prefix(200)) and not store.exists(ck.step_prefix(200) + ck.MANIFEST)
    assert ck.latest_complete(store) == 100 and ck.complete_steps(store) == [100]
    assert ck.read_file(store, 100, "state.pt") == b"complete-100"
    ck.write_checkpoint(store, 200, {"state.pt": b"complete-200"})  # the next try replaces the torn one
    assert ck.latest_complete(store) == 200
    assert [k.rsplit("/", 1)[1] for k, _ in store.list(ck.step_prefix(200))] == [ck.MANIFEST, "state.pt"]


def _local_checkpoint(root: Path, step: int, *, marker_step: int | None = None, data: str = "state.pt") -> Path:
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / data).write_bytes(b"x")
    if marker_step is not None:
        (d / "COMPLETE").write_text(json.dumps({"step": marker_step}))
    return d


def test_local_checkpoints_counted_by_storage_without_the_training_helper(tmp_path):
    """The controller counts a directory's complete checkpoints through sftctl.storage; a
    COMPLETE naming another step, no COMPLETE, a temporary dir or a dir without data are not."""
    root = tmp_path / "ckpt"
    _local_checkpoint(root, 20, marker_step=20)
    _local_checkpoint(root, 5, marker_step=5, data=".metadata")  # a sharded (DCP) one
    _local_checkpoint(root, 30)  # killed before COMPLETE
    _local_checkpoint(root, 40, marker_step=4)  # a marker of another step
    (root / "step-00000050.tmp-123").mkdir()
    empty = root / "step-00000060"
    empty.mkdir()
    (empty / "COMPLETE").write_text('{"step": 60}')  # no state.pt nor .metadata
    assert ck.complete_checkpoint_steps(root) == [5, 20] == ck.complete_checkpoint_steps(str(root))
    assert [p.name for _, p in ck.complete_local_checkpoints(root)] == ["step-00000005", "step-00000020"]
    assert ck.complete_checkpoint_steps(tmp_path / "missing") == []
    # the controller's check of a spec's checkpoint_dir never imports the training helper
    (root / ".sftctl-job").write_text("other-job\n")
    code = ("import sys; from sftctl.controller import check_checkpoint_dir; from sftctl.spec import JobSpec\n"
            f"spec = JobSpec.model_validate({{'name': 'c', 'run': 'true', 'workdir': {str(tmp_path)!r}, "
            "'train': {'checkpoint_dir': 'ckpt'}})\n"
            "try:\n    check_checkpoint_dir(spec)\nexcept Exception as e:\n    print(type(e).__name__, e.message)\n"
            "print('TRAIN', 'sftctl.train' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "SpecError" in proc.stdout and "job other-job (up to step 20)" in proc.stdout, proc.stdout
    assert "TRAIN False" in proc.stdout, proc.stdout


def test_train_helper_checkpoints_through_job_storage(store, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from sftctl import train as sft

    monkeypatch.setenv("SFTCTL_STORAGE_URL", store.url)
    monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(tmp_path / "node-a"))
    for step in (5, 10, 15):
        sft.save_checkpoint({"w": torch.full((3,), float(step)), "step": step}, step, keep=2)
    assert ck.complete_steps(store) == [10, 15] == sft.complete_checkpoint_steps(store.url)
    # a replacement node starts with an empty disk: it resumes from the storage
    monkeypatch.setenv("SFTCTL_CHECKPOINT_DIR", str(tmp_path / "node-b"))
    step, state = sft.load_latest_checkpoint()
    assert step == 15 and torch.equal(state["w"], torch.full((3,), 15.0))
    assert sft.latest_checkpoint() == tmp_path / "node-b" / "step-00000015"
    assert sorted(p.name for p in (tmp_path / "node-b").iterdir()) == ["step-00000015"]
    # a torn upload of a later step is not picked; a newer local checkpoint wins over storage
    store.put_bytes(ck.step_prefix(20) + "state.pt", b"torn")
    assert sft.load_latest_checkpoint()[0] == 15
    monkeypatch.delenv("SFTCTL_STORAGE_URL")
    sft.save_checkpoint({"step": 25}, 25)
    monkeypatch.setenv("SFTCTL_STORAGE_URL", store.url)
    assert sft.load_latest_checkpoint()[0] == 25


# ------------------------------------------------------------------------------------ streams


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.binary(max_size=700), max_size=25), flush_bytes=st.integers(1, 900),
       reads=st.lists(st.integers(1, 2000), min_size=1, max_size=10))
def test_stream_round_trip_random_chunking_local(tmp_path, chunks, flush_bytes, reads):
    store = open_storage(tmp_path / f"s-{uuid.uuid4().hex}")
    clock = [0.0]
    w = StreamWriter(store, "nodes/n/node.log", flush_bytes=flush_bytes, flush_interval_s=2.0, clock=lambda: clock[0])
    r = StreamReader(store, "nodes/n/node.log")
    got, offset, shipped = b"", 0, b""
    for i, chunk in enumerate(chunks):
        w.write(chunk)
        shipped += chunk
        clock[0] += 0.5
        w.poll()
        data, offset = r.read(offset, max_bytes=reads[i % len(reads)])
        got += data
        assert shipped.startswith(got) and offset == len(got)
    w.close()
    while True:
        data, offset = r.read(offset, max_bytes=reads[-1])
        if not data:
            break
        got += data
    assert got == b"".join(chunks) and w.total_bytes == len(got)


def test_stream_json_lines_never_partial(store):
    rng = random.Random(7)
    records = [{"step": i, "loss": rng.random(), "pad": "x" * rng.randrange(0, 300)} for i in range(300)]
    blob = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    w = StreamWriter(store, "nodes/n1/metrics/rank-0.jsonl", flush_bytes=rng.randrange(500, 4000))
    channel = NodeChannel(store)
    offsets: dict[str, int] = {}
    seen: list[dict] = []
    pos = 0
    while pos < len(blob):
        n = rng.randrange(1, 6000)
        w.write(blob[pos:pos + n])  # cut anywhere, mid-line included
        pos += n
        if rng.random() < 0.3:
            w.flush()
        batch = channel.read_metrics("n1", offsets)
        assert all(isinstance(r, dict) and "step" in r for r in batch)
        seen += batch
        assert seen == records[:len(seen)]
    w.close()
    seen += channel.read_metrics("n1", offsets)
    assert seen == records
    # a restarted writer continues the stream
    w2 = StreamWriter(store, "nodes/n1/metrics/rank-0.jsonl")
    assert w2.next_seq == w.next_seq and w2.shipped_bytes == len(blob)
    w2.write(b'{"step": 300}\n')
    w2.close()
    assert channel.read_metrics("n1", offsets) == [{"step": 300}]


def test_stream_writer_flushes_by_size_and_age(tmp_path):
    store = open_storage(tmp_path / "s")
    clock = [0.0]
    w = StreamWriter(store, "p", flush_bytes=10, flush_interval_s=2.0, clock=lambda: clock[0])
    w.write(b"12345")
    assert store.list("p/") == []
    clock[0] = 1.9
    assert not w.poll()
    clock[0] = 2.0
    assert w.poll() and store.list("p/") == [("p/0000000000", 5)]
    w.write(b"0123456789AB")  # over the size: a segment at once
    assert store.list("p/")[-1] == ("p/0000000001", 12)


# ------------------------------------------------------------------------------------ shipper + channel


def test_shipper_and_channel_round_trip(store, tmp_path):
    node = tmp_path / "node"
    (node / "metrics").mkdir(parents=True)
    channel = NodeChannel(store, secret_keys={"DB_URL"})
    env = {"SFTCTL_NODE_RANK": "0", "AWS_SECRET_ACCESS_KEY": SECRET, "HF_TOKEN": "hf-abcdef",
           "DB_URL": "postgres://u:pw@h/db", "OMP_NUM_THREADS": "1"}
    channel.send_launch("n1", 1, "#!/bin/bash\necho hi\n", env)
    assert channel.poll_launch("n1", after_attempt=1) is None
    attempt, script, got_env = channel.poll_launch("n1", 0, environ={"HF_TOKEN": "from-node"})
    assert (attempt, script) == (1, "#!/bin/bash\necho hi\n")
    assert got_env == {"SFTCTL_NODE_RANK": "0", "OMP_NUM_THREADS": "1", "HF_TOKEN": "from-node"}
    launch = json.loads(store.get_bytes("nodes/n1/launch-1.json"))
    assert launch["secret_env"] == ["AWS_SECRET_ACCESS_KEY", "DB_URL", "HF_TOKEN"]
    with pytest.raises(StorageError, match="secret HF_TOKEN") as e:
        channel.send_launch("n1", 2, "export HF_TOKEN=hf-abcdef\n", env)
    assert "hf-abcdef" not in e.value.message + e.value.hint
    channel.send_launch("n1", 2, "run2", {})
    channel.send_launch("n1", 3, "run3", {})
    assert channel.poll_launch("n1", 1)[0] == 3  # the newest one

    shipper = Shipper(store, "n1", node, flush_bytes=64)
    log = node / "node.log"
    log.write_bytes(b"starting\n")
    (node / "health.jsonl").write_text('{"gpu": 0, "temp_c": 40}\n{"gpu": 0, "te')
    (node / "metrics" / "rank-0.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    shipper.ship_once()
    shipper.ship_once(final=True)
    assert channel.exit_code("n1", 1) is None
    data, off = channel.read_log("n1", 0)
    assert data == b"starting\n" and off == 9
    health: dict[str, int] = {}
    assert channel.read_health("n1", health) == [{"gpu": 0, "temp_c": 40}]
    with open(node / "health.jsonl", "a") as f:
        f.write('mp_c": 41}\n')
    metrics: dict[str, int] = {}
    assert channel.read_metrics("n1", metrics) == [{"step": 1, "loss": 2.5}]

    with open(log, "ab") as f:
        f.write(b"x" * 5000 + b"\nfinished\n")
    (node / "metrics" / "rank-1.jsonl").write_text('{"step": 1, "loss": 2.6}\n')
    (node / "exit-1").write_text("3\n")
    shipper.ship_once()  # an exit code ships after every byte logged before it
    assert channel.exit_code("n1", 1) == 3
    data, off2 = channel.read_log("n1", off)
    assert data == b"x" * 5000 + b"\nfinished\n" and off2 == log.stat().st_size
    assert channel.read_health("n1", health) == [{"gpu": 0, "temp_c": 41}]
    assert channel.read_metrics("n1", metrics) == [{"step": 1, "loss": 2.6}]

    # a restarted shipper (a new process on the node) continues without duplicating
    with open(log, "ab") as f:
        f.write(b"attempt 2\n")
    again = Shipper(store, "n1", node).start()
    again.stop()
    assert channel.read_log("n1", off2) == (b"attempt 2\n", log.stat().st_size)
    assert channel.read_log("n1", 0)[0] == log.read_bytes()

    # nothing written anywhere holds a credential's value
    leaked = [k for k, v in _all_objects(store).items() if SECRET.encode() in v or b"hf-abcdef" in v]
    assert not leaked


def test_cloud_provider_speaks_to_storage_channel(tmp_path):
    from sftctl.providers.base import NodeState

    store = open_storage(tmp_path / "s")
    store.ensure(create_bucket=True)
    provider = RunningCloud(channel=NodeChannel(store))
    handle = provider.launch(CloudHandle(job_id="j", node_id="n0", rank=0, id="i-1"), "echo hi", {"A": "1"}, attempt=1)
    assert provider.status(handle).state == NodeState.RUNNING
    node = tmp_path / "node"
    node.mkdir()
    (node / "node.log").write_text("hi\n")
    (node / "exit-1").write_text("0")
    Shipper(store, "n0", node).ship_once()
    assert provider.status(handle).state == NodeState.SUCCEEDED
    assert provider.read_log(handle, 0) == (b"hi\n", 3)
    assert provider.read_metrics(handle, {}) == [] and provider.read_health(handle, {}) == []


def test_failure_record_is_shipped_before_the_exit_code(tmp_path):
    """A node's failure record (sftctl.failure) reaches job storage no later than its exit code,
    and the channel reads it back as a FailureReason."""
    from sftctl.types import FailureCode, FailureReason

    store = open_storage(tmp_path / "s")
    store.ensure(create_bucket=True)
    node = _tree(tmp_path / "node", {"node.log": "boom\n"})
    (node / "failure-2.json").write_text(json.dumps(FailureReason("exception", "rank 1: ValueError: x", {"exit_code": 1}).to_dict()))
    channel = NodeChannel(store)
    Shipper(store, "n0", node).ship_once()
    assert channel.read_failure("n0", 2) is None and channel.exit_code("n0", 2) is None  # no exit code yet
    (node / "exit-2").write_text("1\n")
    Shipper(store, "n0", node).ship_once()
    why = channel.read_failure("n0", 2)
    assert why.code is FailureCode.EXCEPTION and why.message == "rank 1: ValueError: x" and channel.exit_code("n0", 2) == 1
    assert channel.read_failure("n0", 1) is None


def test_no_credential_in_any_object(store, tmp_path, monkeypatch):
    """A whole job's worth of objects (workdir, checkpoints, launch, streams, exit) with the AWS
    secret key in the environment and in the launch env: none of them holds its value."""
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET
    wd = _tree(tmp_path / "wd", {"train.py": "print('hi')\n"})
    upload_workdir(store, wd)
    ck.write_checkpoint(store, 1, {"state.pt": b"weights"})
    channel = NodeChannel(store)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": SECRET, "PATH": os.environ["PATH"]}
    channel.send_launch("n0", 1, "python train.py", env)
    node = _tree(tmp_path / "node", {"node.log": "ok\n", "exit-1": "0\n", "metrics/rank-0.jsonl": '{"step": 1}\n'})
    Shipper(store, "n0", node).ship_once(final=True)
    objects = _all_objects(store)
    assert len(objects) >= 7
    assert [k for k, v in objects.items() if SECRET.encode() in v] == []
    assert "AWS_SECRET_ACCESS_KEY" in json.loads(objects["nodes/n0/launch-1.json"])["secret_env"]


def test_secret_names():
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "WANDB_API_KEY", "DB_PASSWORD",
                 "GOOGLE_APPLICATION_CREDENTIALS", "SSH_PRIVATE_KEY"):
        assert is_secret_name(name), name
    for name in ("SFTCTL_NODE_RANK", "OMP_NUM_THREADS", "PATH", "MASTER_ADDR"):
        assert not is_secret_name(name), name


def test_a_node_whose_daemon_never_takes_the_attempt_is_lost(tmp_path):
    """A bootstrap that never started the daemon: after launch_timeout_s without an ack the node
    is LOST (the controller replaces it) instead of RUNNING forever; an ack keeps it RUNNING."""
    from sftctl.providers.base import NodeState

    store = open_storage(tmp_path / "s")
    store.ensure(create_bucket=True)
    provider = RunningCloud(channel=NodeChannel(store))
    provider.launch_timeout_s = 5.0
    handle = provider.launch(CloudHandle(job_id="j", node_id="n0", rank=0, id="i-1"), "echo hi", {}, attempt=1)
    assert provider.status(handle).state == NodeState.RUNNING
    late = handle.with_(launched_at=handle.launched_at - 6.0)
    status = provider.status(late)
    assert status.state == NodeState.LOST and "did not take attempt 1 within 5 s" in status.detail
    store.put_bytes("nodes/n0/ack-1", b"123\n")
    assert provider.status(late).state == NodeState.RUNNING



class RunningCloud(CloudProvider):
    """A cloud whose every instance runs: only the storage channel decides the node's state."""

    name = "fake"

    def describe(self, handle):
        return InstanceState.RUNNING
