"""Checkpoint write and read throughput to S3 (moto's server on loopback) next to a plain local copy.

One checkpoint of ``--mb`` MB of random bytes (default 500, incompressible like trained weights),
side by side in one run:

* local copy: ``shutil.copyfile`` of the file to another file on the same disk (write), and of
  that copy back (read). The page cache serves both: this is the ceiling, not a disk figure.
* S3 checkpoint: :func:`sftctl.storage.checkpoints.write_checkpoint` (sha256 of the file,
  multipart upload in 32 MiB parts, 8 in parallel, then the manifest) and
  :func:`~sftctl.storage.checkpoints.download_checkpoint` (ranged parallel download, then the
  sha256 check), to a moto server this script starts on a free loopback port;
* S3 raw: ``upload_file`` / ``download_file`` of the same object without the manifest and the
  sha256 sums, so the cost of the checks shows.

moto keeps objects in its own process's memory over HTTP on loopback, so the S3 figures measure
sftctl + boto3 + HTTP + moto on this machine's cores, not a real S3 link (which is typically
100-1000 MB/s per instance with parallel parts).

    python benchmarks/storage_throughput.py            # 500 MB
    python benchmarks/storage_throughput.py --mb 50    # a quick run
Writes benchmarks/results/storage_throughput.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "storage_throughput.json"
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if time.monotonic() > end or proc.poll() is not None:
                raise RuntimeError("moto server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=500, help="checkpoint size in MB (10^6 bytes)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    nbytes = args.mb * 1000 * 1000

    with tempfile.TemporaryDirectory(prefix="sftctl-bench-") as tmp, moto_server() as endpoint:
        tmp = Path(tmp)
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
        from sftctl.storage import open_storage
        from sftctl.storage import checkpoints as ck

        src = tmp / "state.pt"
        with open(src, "wb") as fh:
            for _ in range(0, nbytes, 8 * 1000 * 1000):
                fh.write(os.urandom(min(8 * 1000 * 1000, nbytes - fh.tell())))
        store = open_storage("s3://sftctl-bench/job-1")
        store.ensure(create_bucket=True)

        seconds = {
            "local copy write": timed(lambda: shutil.copyfile(src, tmp / "copy.pt")),
            "local copy read": timed(lambda: shutil.copyfile(tmp / "copy.pt", tmp / "copy2.pt")),
        }
        (tmp / "copy.pt").unlink()
        (tmp / "copy2.pt").unlink()
        seconds["s3 checkpoint write"] = timed(lambda: ck.write_checkpoint(store, 100, {"state.pt": src}, keep=1))
        seconds["s3 checkpoint read"] = timed(lambda: ck.download_checkpoint(store, 100, tmp / "dl"))
        assert (tmp / "dl" / "state.pt").stat().st_size == nbytes
        shutil.rmtree(tmp / "dl")
        seconds["s3 raw upload_file"] = timed(lambda: store.upload_file("raw/state.pt", src))
        seconds["s3 raw download_file"] = timed(lambda: store.download_file("raw/state.pt", tmp / "raw.pt"))

    mb_per_s = {name: args.mb / s for name, s in seconds.items()}
    ratio = {
        "write: s3 checkpoint / local copy": mb_per_s["s3 checkpoint write"] / mb_per_s["local copy write"],
        "read: s3 checkpoint / local copy": mb_per_s["s3 checkpoint read"] / mb_per_s["local copy read"],
    }
    width = max(map(len, seconds))
    print(f"checkpoint of {args.mb} MB, moto S3 on loopback vs shutil.copyfile ({os.cpu_count()} cores)")
    for name in seconds:
        print(f"  {name:<{width}}  {seconds[name]:7.2f} s  {mb_per_s[name]:8.1f} MB/s")
    for name, r in ratio.items():
        print(f"  {name}: {r:.3f}")
    doc = {
        "date": datetime.date.today().isoformat(),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "checkpoint_mb": args.mb,
        "seconds": seconds,
        "mb_per_s": mb_per_s,
        "ratio": ratio,
        "notes": "S3 is moto's server in-process memory over loopback HTTP; local copy is page-cache bound.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
