"""Durable job storage: one small object-store interface over S3, GCS and a local directory.

A job's storage is a URL naming a bucket and a prefix (or a directory); every key below is
relative to that prefix::

    s3://bucket/prefix          boto3; honours AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 (moto, MinIO)
    gs://bucket/prefix          google-cloud-storage; honours STORAGE_EMULATOR_HOST
    file:///abs/path            a directory on this machine (or a network file system)
    /abs/path, rel/path         the same, as a plain path
    pvc://claim-name/prefix     a Kubernetes PersistentVolumeClaim as the pods see it: the claim is
                                mounted at $SFTCTL_PVC_MOUNT (default /mnt/sftctl), so this is the
                                directory $SFTCTL_PVC_MOUNT/prefix

What sftctl keeps there (the layout the other modules write)::

    .sftctl-storage.json                 marker: written by ensure(); says whether sftctl created the bucket
    workdir/<sha256>.tar.gz              the packed workdir (sftctl.storage.workdir)
    checkpoints/step-%08d/...            checkpoints, MANIFEST.json written last (sftctl.storage.checkpoints)
    nodes/<node id>/...                  the controller <-> node protocol: launch requests, acks,
                                         stop requests, exit codes and the node's log, metrics and
                                         GPU-sample streams (specified in sftctl.protocol; streams
                                         as numbered segments, sftctl.storage.stream)

Importing this module is cheap: boto3 and google-cloud-storage are imported by the backend that
needs them, when a storage of that kind is opened.

Errors are :class:`StorageError` (a :class:`~sftctl.errors.ProviderError`, exit code 4): one line
naming the storage URL and what failed, with a hint. Credential values never appear in them.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Iterator

from sftctl import settings


__all__ = [
    "MARKER_KEY",
    "BucketNotFoundError",
    "LocalStorage",
    "Storage",
    "StorageAccessDenied",
    "StorageError",
    "StorageNotFound",
    "open_storage",
]

from sftctl.storage.base import (  # noqa: F401 - the package's names (base: what every backend shares)
    MARKER_KEY,
    MULTIPART_CHUNK_BYTES,
    MULTIPART_THRESHOLD_BYTES,
    SFTCTL_PREFIXES,
    TRANSFER_CONCURRENCY,
    BucketNotFoundError,
    Storage,
    StorageAccessDenied,
    StorageError,
    StorageNotFound,
    _check_key,
    _TMP_MARK,
    _check_prefix,
    atomic_tempfile,
)


# --------------------------------------------------------------------------------------------
# opening
# --------------------------------------------------------------------------------------------


def open_storage(url: str | os.PathLike) -> Storage:
    """Open the storage named by ``url`` (see the module docstring for the schemes).

    Nothing is contacted here (no network call, no directory created): call
    :meth:`Storage.ensure` to check that the bucket exists.

    Raises:
        StorageError: the URL is malformed or its scheme unknown (the message names it).
        ImportError: the backend's SDK (boto3, google-cloud-storage) is not installed.
    """
    raw = os.fspath(url)
    if not raw:
        raise StorageError("storage URL is empty", hint="use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or a directory")
    scheme, sep, rest = raw.partition("://")
    if not sep:
        return LocalStorage(Path(raw).expanduser().resolve())
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise StorageError(f"storage URL {raw!r}: file:// needs an absolute path (file:///abs/path)",
                               hint="write file:///abs/path, or a plain directory path")
        return LocalStorage(Path(rest).resolve())
    if scheme == "pvc":
        claim, _, prefix = rest.partition("/")
        if not claim:
            raise StorageError(f"storage URL {raw!r}: no claim name", hint="write pvc://CLAIM/PREFIX")

        mount = Path(settings.get("SFTCTL_PVC_MOUNT"))
        prefix = _clean_prefix(raw, prefix)
        root = mount / prefix if prefix else mount
        return LocalStorage(root, url=f"pvc://{claim}/{prefix}".rstrip("/"), mount=mount)
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StorageError(f"storage URL {raw!r}: no bucket name", hint=f"write {scheme}://BUCKET/PREFIX")
        prefix = _clean_prefix(raw, prefix)
        if scheme == "s3":
            from sftctl.storage.s3 import S3Storage

            return S3Storage(bucket, prefix)
        from sftctl.storage.gcs import GCSStorage

        return GCSStorage(bucket, prefix)
    raise StorageError(f"storage URL {raw!r}: unknown scheme {scheme!r}",
                       hint="use s3://, gs://, file://, pvc:// or a plain directory path")


def _clean_prefix(url: str, prefix: str) -> str:
    prefix = prefix.strip("/")
    if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
        raise StorageError(f"storage URL {url!r}: bad prefix {prefix!r}", hint="use a/b/c without '.', '..' or '//'")
    return prefix


# --------------------------------------------------------------------------------------------
# the local backend (a directory; also a Kubernetes PVC as mounted into the pods)
# --------------------------------------------------------------------------------------------


class LocalStorage(Storage):
    """Objects as files under a directory ``root``: key ``a/b`` is the file ``root/a/b``.

    Writes go to a temporary file next to the target (named ``.sftctl-tmp-*``, never listed)
    and are renamed into place, so readers on this machine or on a shared volume (NFS, a PVC)
    see whole objects only.

    Args:
        root: the directory (the "bucket" for a ``file://`` URL or plain path).
        url: the URL to report; default ``file://<root>``.
        mount: for ``pvc://`` URLs, where the claim is mounted: it must exist (sftctl cannot
            create a volume), while ``root`` below it is created by ``ensure``.
    """

    def __init__(self, root: Path, url: str | None = None, mount: Path | None = None):
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.mount = mount
        if mount is not None:
            self._bucket_word = f"volume mount {mount}"
            self._bucket_hint = "mount the claim there, or set SFTCTL_PVC_MOUNT to where it is mounted"
        else:
            self._bucket_word = f"directory {self.root}"
            self._bucket_hint = f"mkdir -p {self.root}"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*_check_key(key).split("/"))

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except PermissionError as e:
            raise StorageAccessDenied(f"storage {self.url}: permission denied {what}: {e.filename}",
                                      hint="check the directory's owner and mode", url=self.url) from None
        except (IsADirectoryError, NotADirectoryError) as e:
            raise StorageError(f"storage {self.url}: {what}: {e.strerror}: {e.filename}",
                               hint="a key cannot be both an object and a prefix of another key",
                               url=self.url) from None
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise StorageError(f"storage {self.url}: {what}: {e.strerror or e}", url=self.url) from None

    def _write_atomic(self, path: Path, fill) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_MARK}{path.name}.{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as fh:
                fill(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(f"writing {key}"):
            self._write_atomic(self._path(key), lambda fh: fh.write(data))

    def get_bytes(self, key: str, start: int = 0) -> bytes:
        path = self._path(key)
        with self._errors(f"reading {key}"):
            try:
                with open(path, "rb") as fh:
                    if start:
                        fh.seek(start)
                    return fh.read()
            except (FileNotFoundError, IsADirectoryError):
                raise self._no_object(key) from None

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if stat.S_ISDIR(st.st_mode) else st.st_size

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[tuple[str, int]]:
        _check_prefix(prefix)
        # walk only the deepest directory the prefix names
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.root.joinpath(*base.split("/")) if base else self.root
        out = []
        with self._errors(f"listing {prefix or '/'}"):
            for dirpath, dirnames, filenames in os.walk(top):
                rel = os.path.relpath(dirpath, self.root)
                rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                # prune directories that cannot hold keys with this prefix
                dirnames[:] = [d for d in dirnames
                               if (rel + d + "/").startswith(prefix) or prefix.startswith(rel + d + "/")]
                for name in filenames:
                    key = rel + name
                    if name.startswith(_TMP_MARK) or not key.startswith(prefix):
                        continue
                    if start_after is not None and key <= start_after:
                        continue
                    try:
                        out.append((key, os.stat(os.path.join(dirpath, name)).st_size))
                    except FileNotFoundError:  # deleted while listing
                        continue
        out.sort(key=lambda kv: kv[0].encode())
        return out

    def children(self, prefix: str) -> builtins.list[str]:
        _check_prefix(prefix)
        top = self.root.joinpath(*prefix.strip("/").split("/")) if prefix.strip("/") else self.root
        try:
            names = os.listdir(top)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((n for n in names if not n.startswith(_TMP_MARK)), key=str.encode)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._errors(f"deleting {key}"):
            try:
                path.unlink()
            except FileNotFoundError:
                return
        # remove directories left empty, up to the root (object stores have no directories)
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        with self._errors(f"uploading {key}"), open(path, "rb") as src:
            self._write_atomic(self._path(key), lambda fh: shutil.copyfileobj(src, fh, 8 * 1024 * 1024))

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        src_path = self._path(key)
        dest = Path(path)
        with self._errors(f"downloading {key}"):
            try:
                src = open(src_path, "rb")
            except (FileNotFoundError, IsADirectoryError):
                raise self._no_object(key) from None
            with src:
                self._write_atomic(dest, lambda fh: shutil.copyfileobj(src, fh, 8 * 1024 * 1024))

    def _bucket_exists(self) -> bool:
        if self.mount is not None:
            if not self.mount.is_dir():
                return False
            with self._errors(f"creating {self.root}"):
                self.root.mkdir(parents=True, exist_ok=True)
            return True
        return self.root.is_dir()

    def _create_bucket(self) -> None:
        if self.mount is not None:  # a volume cannot be created from here
            raise BucketNotFoundError(f"storage {self.url}: the {self._bucket_word} does not exist",
                                      hint=self._bucket_hint, url=self.url)
        with self._errors(f"creating {self.root}"):
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError, FileNotFoundError) as e:  # a file in the way; /proc
                raise StorageError(f"storage {self.url}: cannot create the directory {self.root}: {e.strerror}",
                                   hint="use a directory you can write to", url=self.url) from None

    def _delete_bucket(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)
