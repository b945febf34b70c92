"""What every job storage backend shares: the :class:`Storage` interface, its errors and key
checks, and the transfer sizes. :mod:`sftctl.storage` (the directory backend, ``open_storage``)
and the cloud backends (:mod:`sftctl.storage.s3`, :mod:`sftctl.storage.gcs`) build on it; it
imports none of them.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

from sftctl.errors import CredentialsError, ProviderError


#: The marker object ``ensure`` writes under the prefix (see :meth:`Storage.ensure`).
MARKER_KEY = ".sftctl-storage.json"
#: The top-level key prefixes sftctl writes; ``purge`` deletes only these and the marker.
SFTCTL_PREFIXES = ("workdir/", "checkpoints/", "nodes/")
#: Objects at least this big go up and down in parts (S3 multipart, GCS resumable chunks).
MULTIPART_THRESHOLD_BYTES = 32 * 1024 * 1024
MULTIPART_CHUNK_BYTES = 32 * 1024 * 1024
#: Parallel part transfers per file (S3).
TRANSFER_CONCURRENCY = 8


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


class StorageError(ProviderError):
    """Job storage failed: unreachable, a missing bucket, a bad URL. Exit code 4.

    ``url`` is the storage URL it happened on (never with credentials: URLs hold none).
    """

    def __init__(self, message: str, hint: str | None = None, url: str | None = None):
        super().__init__(message, hint)
        self.url = url


class StorageNotFound(StorageError):
    """A key that does not exist (``get_bytes``, ``download_file``). ``key`` names it."""

    def __init__(self, message: str, hint: str | None = None, url: str | None = None, key: str = ""):
        super().__init__(message, hint, url)
        self.key = key


class BucketNotFoundError(StorageError):
    """The bucket (or the directory) of the storage URL does not exist."""


class StorageAccessDenied(StorageError, CredentialsError):
    """Credentials are missing or lack a permission on the bucket. Exit code 4."""


# --------------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------------


def _check_key(key: str) -> str:
    """Validate a storage key: relative, ``/``-separated, no empty, ``.`` or ``..`` parts."""
    if not isinstance(key, str) or not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"bad storage key {key!r}: expected a relative 'a/b/c' path")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in ("", ".", ".."):
        raise ValueError(f"bad storage key {key!r}: empty, '.' or '..' path segment")
    return key


def _check_prefix(prefix: str) -> str:
    """A list prefix may be empty or end in anything (it is a string prefix, not a directory)."""
    if prefix and (prefix.startswith("/") or "\\" in prefix or ".." in prefix.split("/")):
        raise ValueError(f"bad storage prefix {prefix!r}")
    return prefix


class Storage:
    """A bucket + prefix (or a directory) holding a job's durable objects.

    Keys are relative ``/``-separated paths (``checkpoints/step-00000100/state.pt``); the
    backend adds its prefix. Writes are whole-object and atomic: a reader sees either no object
    or all of it (S3 and GCS give that; :class:`LocalStorage` renames a temporary file). Reads
    after a write are strongly consistent on all three backends, and so are listings.

    Subclasses implement the ``_``-less methods below; all of them raise :class:`StorageError`
    (or a subclass) for anything that is not a programming error.

    Attributes:
        url: the storage URL this was opened from, normalized (``s3://bucket/prefix``).
    """

    url: str

    # ------------------------------------------------------------ objects
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write ``data`` as object ``key``, replacing any object there."""
        raise NotImplementedError

    def get_bytes(self, key: str, start: int = 0) -> bytes:
        """The bytes of object ``key`` from byte ``start`` on (a range read when ``start > 0``).

        Raises:
            StorageNotFound: there is no object ``key``.
        """
        raise NotImplementedError

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[tuple[str, int]]:
        """``[(key, size in bytes)]`` of every object whose key starts with ``prefix``, sorted by
        key (byte order), only keys greater than ``start_after`` when given.

        The marker object is listed like any other; temporary files of :class:`LocalStorage`
        are not.
        """
        raise NotImplementedError

    def children(self, prefix: str) -> builtins.list[str]:
        """The names directly below the "directory" ``prefix`` (which should end in ``/``):
        ``children("nodes/n1/metrics/")`` -> ``["rank-0.jsonl", "rank-1.jsonl"]`` whether those
        are objects or prefixes of deeper keys. Sorted, one listing call (a delimiter listing)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Delete object ``key``; a missing object is not an error."""
        raise NotImplementedError

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; return how many were deleted.

        ``prefix`` must not be empty (use :meth:`purge` to remove everything sftctl wrote).
        """
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix")
        keys = [key for key, _ in self.list(prefix)]
        self._delete_many(keys)
        return len(keys)

    def delete_prefixes(self, prefixes=SFTCTL_PREFIXES) -> tuple[int, int]:
        """Delete every object under each of ``prefixes`` (default: the ones sftctl writes,
        :data:`SFTCTL_PREFIXES`); return ``(objects, bytes)`` deleted. Nothing else is touched."""
        if not prefixes or any(not p for p in prefixes):
            raise ValueError("delete_prefixes needs non-empty prefixes")
        objects = [kv for p in prefixes for kv in self.list(p)]
        self._delete_many([key for key, _ in objects])
        return len(objects), sum(size for _, size in objects)

    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists."""
        return self.size(key) is not None

    def size(self, key: str) -> int | None:
        """The size of object ``key`` in bytes, or None if it does not exist."""
        raise NotImplementedError

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        """Upload the file at ``path`` as object ``key``; big files go in parallel parts
        (S3 multipart with boto3's TransferConfig, GCS resumable upload in chunks)."""
        raise NotImplementedError

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        """Download object ``key`` to ``path`` (written to a temporary file in the same
        directory, then renamed: ``path`` never holds a partial object). Big objects come in
        parallel ranged parts (S3) or chunks (GCS).

        Raises:
            StorageNotFound: there is no object ``key``.
        """
        raise NotImplementedError

    # ------------------------------------------------------------ the bucket
    def ensure(self, create_bucket: bool = False) -> dict:
        """Check the bucket exists and is writable; create it only when ``create_bucket``.

        Writes the marker object :data:`MARKER_KEY` the first time, recording whether sftctl
        created the bucket (``{"created_bucket": true|false, "created_at": unix s}``); an
        existing marker is kept as it is, so a bucket sftctl did not create never becomes one it
        did. Returns the marker's content.

        Raises:
            BucketNotFoundError: the bucket does not exist and ``create_bucket`` is False.
            StorageAccessDenied: the credentials cannot read or write it.
        """
        created = False
        if not self._bucket_exists():
            if not create_bucket:
                raise BucketNotFoundError(
                    f"storage {self.url}: the {self._bucket_word} does not exist",
                    hint=f"create it ({self._bucket_hint}), or let sftctl: storage: {{url: {self.url}, create_bucket: true}}",
                    url=self.url,
                )
            self._create_bucket()
            created = True
        try:
            return json.loads(self.get_bytes(MARKER_KEY))
        except (StorageNotFound, ValueError):
            pass
        marker = {"created_by": "sftctl", "created_bucket": created, "created_at": time.time()}
        self.put_bytes(MARKER_KEY, json.dumps(marker, sort_keys=True).encode())
        return marker

    def purge(self, delete_bucket: bool = True) -> int:
        """Delete what sftctl wrote here: the objects under ``workdir/``, ``checkpoints/`` and
        ``nodes/``, then the marker; then the bucket itself, if the marker says sftctl created
        it, ``delete_bucket`` is set and the bucket is now empty. Objects anywhere else, and
        buckets sftctl did not create, are never touched. Returns the number of objects deleted.

        Raises:
            StorageError: there is no marker (``ensure`` never ran here): nothing is deleted.
        """
        try:
            marker = json.loads(self.get_bytes(MARKER_KEY))
        except (StorageNotFound, ValueError):
            raise StorageError(
                f"storage {self.url}: no {MARKER_KEY} marker, so sftctl did not set it up; not deleting anything",
                hint="delete its objects yourself if they are no longer needed",
                url=self.url,
            ) from None
        n = self.delete_prefixes(SFTCTL_PREFIXES)[0]
        self.delete(MARKER_KEY)
        n += 1
        if delete_bucket and marker.get("created_bucket") and not self.list(""):
            self._delete_bucket()
        return n

    # ------------------------------------------------------------ backend hooks
    _bucket_word = "bucket"
    _bucket_hint = "check the bucket name"

    def _bucket_exists(self) -> bool:
        raise NotImplementedError

    def _create_bucket(self) -> None:
        raise NotImplementedError

    def _delete_bucket(self) -> None:
        raise NotImplementedError

    def _delete_many(self, keys: builtins.list[str]) -> None:
        for key in keys:
            self.delete(key)

    def _no_object(self, key: str) -> StorageNotFound:
        """The error every backend raises for a missing object ``key``: ``storage <url>: no
        object <key>``."""
        return StorageNotFound(f"storage {self.url}: no object {key}", url=self.url, key=key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class BucketStorage(Storage):
    """What the cloud backends (:mod:`~sftctl.storage.s3`, :mod:`~sftctl.storage.gcs`) share: the
    URL ``<scheme>://<bucket>/<prefix>`` and the object names of keys, ``<prefix>/<key>`` in the
    bucket (``<key>`` when the prefix is empty).

    Args:
        scheme: ``"s3"`` or ``"gs"``.
        bucket: the bucket's name (the subclass keeps it under its own attribute).
        prefix: the key prefix, without leading or trailing ``/`` (``""``: the bucket's root).
        bucket_hint: how to create the bucket, for the error a missing one raises.
    """

    def __init__(self, scheme: str, bucket: str, prefix: str, bucket_hint: str):
        self.prefix = prefix
        self.url = f"{scheme}://{bucket}/{prefix}".rstrip("/")
        self._bucket_word = f"bucket {bucket}"
        self._bucket_hint = bucket_hint

    def _no_bucket(self, what: str) -> BucketNotFoundError:
        """The error of a request (``what``: ``"reading ckpt/x"``) that found no bucket:
        ``storage <url>: bucket <name> does not exist (<what>)``, with the hint to create it."""
        return BucketNotFoundError(f"storage {self.url}: {self._bucket_word} does not exist ({what})",
                                   hint=self._bucket_hint, url=self.url)

    def _full(self, name: str) -> str:
        """The object name of ``name``, a key or a list prefix, unchecked: ``<prefix>/<name>``."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def _k(self, key: str) -> str:
        """The object name of ``key``. Raises ValueError for a malformed key (:func:`_check_key`)."""
        return self._full(_check_key(key))

    def _rel(self, full: str) -> str:
        """The key of object name ``full`` (one under the prefix): the inverse of :meth:`_k`."""
        return full[len(self.prefix) + 1:] if self.prefix else full


#: Temporary files written next to their target (never listed as keys).
_TMP_MARK = ".sftctl-tmp-"


def atomic_tempfile(dest: Path) -> tuple[int, str]:
    """A temporary file next to ``dest`` (for downloads renamed into place): ``(fd, path)``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=f"{_TMP_MARK}{dest.name}.", dir=dest.parent)


@contextlib.contextmanager
def atomic_download(dest: Path) -> Iterator[tuple[int, str]]:
    """Write a download in place whole: yields ``(fd, path)`` of an open temporary file next to
    ``dest`` (:func:`atomic_tempfile`; the caller closes ``fd``), renamed to ``dest`` when the
    block ends; on any exception the temporary file is removed and the exception goes on, so
    ``dest`` never holds a partial object."""
    fd, tmp = atomic_tempfile(dest)
    try:
        yield fd, tmp
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
