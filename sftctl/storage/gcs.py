"""The GCS backend of :mod:`sftctl.storage` (google-cloud-storage). Imported only for ``gs://`` URLs.

Credentials come from Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's
login, the instance's service account). With ``STORAGE_EMULATOR_HOST`` set the client talks to
that emulator anonymously. The project (needed only to create a bucket) is
``GOOGLE_CLOUD_PROJECT`` / ``CLOUDSDK_CORE_PROJECT``, else the credentials' project.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import threading
from pathlib import Path
from typing import Iterator

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.cloud import storage as gcs

from sftctl.storage.base import (
    MULTIPART_CHUNK_BYTES,
    MULTIPART_THRESHOLD_BYTES,
    BucketStorage,
    StorageAccessDenied,
    StorageError,
    StorageNotFound,
    _check_prefix,
    atomic_download,
)

_CRED_HINT = ("run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS, "
              "and grant roles/storage.objectAdmin on the bucket")


class GCSStorage(BucketStorage):
    """``gs://bucket/prefix`` through one google-cloud-storage client, created on first use."""

    def __init__(self, bucket: str, prefix: str = ""):
        super().__init__("gs", bucket, prefix, f"gcloud storage buckets create gs://{bucket}, or check the name")
        self.bucket_name = bucket
        self._client: gcs.Client | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> gcs.Client:
        with self._lock:
            if self._client is None:
                project = os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT")
                with self._errors("connecting"):
                    if os.environ.get("STORAGE_EMULATOR_HOST"):
                        from google.auth.credentials import AnonymousCredentials

                        self._client = gcs.Client(project=project or "sftctl-emulator",
                                                  credentials=AnonymousCredentials())
                    else:
                        self._client = gcs.Client(project=project)
            return self._client

    @property
    def bucket(self) -> gcs.Bucket:
        return self.client.bucket(self.bucket_name)

    def _blob(self, key: str, big: bool = False) -> gcs.Blob:
        blob = self.bucket.blob(self._k(key))
        if big:  # resumable upload / chunked download in MULTIPART_CHUNK_BYTES pieces
            blob.chunk_size = MULTIPART_CHUNK_BYTES
        return blob

    @contextlib.contextmanager
    def _errors(self, what: str, key: str = "") -> Iterator[None]:
        """Translate Google errors into one-line StorageErrors naming the URL (never a credential)."""
        try:
            yield
        except gexc.NotFound:
            if key:
                raise self._no_object(key) from None
            raise self._no_bucket(what) from None
        except (gexc.Forbidden, gexc.Unauthorized) as e:
            raise StorageAccessDenied(f"storage {self.url}: access denied {what} ({e.code})",
                                      hint=_CRED_HINT, url=self.url) from None
        except auth_exc.DefaultCredentialsError:
            raise StorageAccessDenied(f"storage {self.url}: no Google credentials found ({what})",
                                      hint=_CRED_HINT, url=self.url) from None
        except auth_exc.GoogleAuthError as e:
            raise StorageAccessDenied(f"storage {self.url}: Google authentication failed {what} "
                                      f"({type(e).__name__})", hint=_CRED_HINT, url=self.url) from None
        except gexc.Conflict:
            raise StorageError(f"storage {self.url}: {what}: conflict (the bucket name may be taken)",
                               hint="bucket names are global: pick another", url=self.url) from None
        except gexc.GoogleAPICallError as e:
            raise StorageError(f"storage {self.url}: {what} failed: HTTP {e.code}",
                               hint="retry; if it persists, check the bucket in the console",
                               url=self.url) from None
        except (ConnectionError, OSError) as e:
            if isinstance(e, FileNotFoundError) and e.filename:
                raise  # a local file the caller named
            raise StorageError(f"storage {self.url}: cannot reach Cloud Storage ({what}): {type(e).__name__}",
                               hint="check the network (and STORAGE_EMULATOR_HOST if you use one)",
                               url=self.url) from None

    # ------------------------------------------------------------ objects
    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(f"writing {key}"):
            self._blob(key).upload_from_string(bytes(data), content_type="application/octet-stream")

    def get_bytes(self, key: str, start: int = 0) -> bytes:
        with self._errors(f"reading {key}", key):
            blob = self._blob(key)
            if not start:
                return blob.download_as_bytes()
            size = self.size(key)
            if size is None:
                raise self._no_object(key)
            if start >= size:
                return b""
            return blob.download_as_bytes(start=start)

    def size(self, key: str) -> int | None:
        with self._errors(f"reading {key}"):
            blob = self.bucket.get_blob(self._k(key))
        return None if blob is None else int(blob.size)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[tuple[str, int]]:
        kw = {"prefix": self._full(_check_prefix(prefix))}
        if start_after is not None:
            # start_offset is inclusive; the emulator ignores it, so filter here too
            kw["start_offset"] = self._full(start_after) + "\x00"
        with self._errors(f"listing {prefix or '/'}"):
            out = [(self._rel(b.name), int(b.size)) for b in self.client.list_blobs(self.bucket_name, **kw)]
        if start_after is not None:
            out = [kv for kv in out if kv[0] > start_after]
        out.sort(key=lambda kv: kv[0].encode())
        return out

    def children(self, prefix: str) -> builtins.list[str]:
        full = self._full(_check_prefix(prefix))
        with self._errors(f"listing {prefix or '/'}"):
            it = self.client.list_blobs(self.bucket_name, prefix=full, delimiter="/")
            names = {b.name[len(full):] for b in it}
            names.update(p[len(full):].rstrip("/") for p in it.prefixes)
        return sorted((n for n in names if n), key=str.encode)

    def delete(self, key: str) -> None:
        try:
            with self._errors(f"deleting {key}", key):
                self._blob(key).delete()
        except StorageNotFound:
            pass

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        big = os.path.getsize(path) >= MULTIPART_THRESHOLD_BYTES
        with self._errors(f"uploading {key}"):
            self._blob(key, big).upload_from_filename(os.fspath(path), content_type="application/octet-stream")

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        size = self.size(key)
        if size is None:
            raise self._no_object(key)
        with atomic_download(Path(path)) as (fd, _), os.fdopen(fd, "wb") as fh, \
                self._errors(f"downloading {key}", key):
            self._blob(key, size >= MULTIPART_THRESHOLD_BYTES).download_to_file(fh)

    # ------------------------------------------------------------ the bucket
    def _bucket_exists(self) -> bool:
        with self._errors("checking the bucket"):
            return self.bucket.exists()

    def _create_bucket(self) -> None:
        with self._errors("creating the bucket"):
            self.client.create_bucket(self.bucket_name)

    def _delete_bucket(self) -> None:
        with self._errors("deleting the bucket"):
            self.bucket.delete()
