"""The S3 backend of :mod:`sftctl.storage` (boto3). Imported only when an ``s3://`` URL is opened.

The endpoint comes from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` when set (moto's server,
MinIO, a VPC endpoint), with path-style addressing there; credentials and region come from boto3's
usual chain (environment, profile, instance role). Retries use botocore's ``standard`` mode.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from pathlib import Path
from typing import Iterator

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from sftctl.storage.base import (
    MULTIPART_CHUNK_BYTES,
    MULTIPART_THRESHOLD_BYTES,
    TRANSFER_CONCURRENCY,
    BucketNotFoundError,
    BucketStorage,
    StorageAccessDenied,
    StorageError,
    StorageNotFound,
    _check_prefix,
    atomic_download,
)

_DENIED = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "ExpiredToken", "InvalidToken", "AllAccessDisabled", "AccountProblem"}
_NO_KEY = {"NoSuchKey", "404", "NotFound"}
_CRED_HINT = ("set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, and allow "
              "s3:GetObject, s3:PutObject, s3:ListBucket, s3:DeleteObject on the bucket")


class S3Storage(BucketStorage):
    """``s3://bucket/prefix`` through one boto3 client (thread-safe; shared by transfers)."""

    def __init__(self, bucket: str, prefix: str = ""):
        super().__init__("s3", bucket, prefix, f"aws s3 mb s3://{bucket}, or check the name and region")
        self.bucket = bucket
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        config = botocore.config.Config(
            retries={"max_attempts": 6, "mode": "standard"},
            max_pool_connections=max(10, TRANSFER_CONCURRENCY * 2),
            s3={"addressing_style": "path"} if endpoint else {},
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD_BYTES,
                                       multipart_chunksize=MULTIPART_CHUNK_BYTES,
                                       max_concurrency=TRANSFER_CONCURRENCY, use_threads=True)

    @contextlib.contextmanager
    def _errors(self, what: str, key: str = "") -> Iterator[None]:
        """Translate boto errors into one-line StorageErrors naming the URL (never a credential)."""
        try:
            yield
        except botocore.exceptions.ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            if code in _NO_KEY and key:
                raise self._no_object(key) from None
            if code == "NoSuchBucket" or (code in _NO_KEY and not key):
                raise self._no_bucket(what) from None
            if code == "InvalidBucketName":
                raise StorageError(f"storage {self.url}: invalid bucket name {self.bucket!r}",
                                   hint="S3 bucket names are 3-63 lowercase letters, digits, '.' and '-'",
                                   url=self.url) from None
            if code == "BucketAlreadyExists":
                raise StorageError(f"storage {self.url}: bucket name {self.bucket} is taken by another account",
                                   hint="bucket names are global: pick another", url=self.url) from None
            if code in _DENIED or code in ("401", "403"):  # HeadBucket has no body: only the status
                raise StorageAccessDenied(f"storage {self.url}: access denied {what} ({code})",
                                          hint=_CRED_HINT, url=self.url) from None
            raise StorageError(f"storage {self.url}: {what} failed: {code or 'error'}",
                               hint="retry; if it persists, check the bucket in the AWS console",
                               url=self.url) from None
        except (botocore.exceptions.NoCredentialsError, botocore.exceptions.PartialCredentialsError):
            raise StorageAccessDenied(f"storage {self.url}: no AWS credentials found ({what})",
                                      hint=_CRED_HINT, url=self.url) from None
        except botocore.exceptions.EndpointConnectionError:
            raise StorageError(f"storage {self.url}: cannot reach the S3 endpoint ({what})",
                               hint="check the network, AWS_ENDPOINT_URL and AWS_DEFAULT_REGION",
                               url=self.url) from None
        except botocore.exceptions.BotoCoreError as e:
            raise StorageError(f"storage {self.url}: {what} failed: {type(e).__name__}",
                               hint="retry; check AWS_ENDPOINT_URL and the network", url=self.url) from None

    # ------------------------------------------------------------ objects
    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(f"writing {key}"):
            self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=bytes(data))

    def get_bytes(self, key: str, start: int = 0) -> bytes:
        kw = {"Range": f"bytes={start}-"} if start else {}
        try:
            with self._errors(f"reading {key}", key):
                return self.client.get_object(Bucket=self.bucket, Key=self._k(key), **kw)["Body"].read()
        except StorageError as e:
            if start and "InvalidRange" in e.message:  # asking from exactly the end
                if self.size(key) is not None:
                    return b""
            raise

    def size(self, key: str) -> int | None:
        try:
            with self._errors(f"reading {key}", key):
                return self.client.head_object(Bucket=self.bucket, Key=self._k(key))["ContentLength"]
        except StorageNotFound:
            return None

    def list(self, prefix: str = "", *, start_after: str | None = None) -> list[tuple[str, int]]:
        kw = {"Bucket": self.bucket, "Prefix": self._full(_check_prefix(prefix))}
        if start_after is not None:
            kw["StartAfter"] = self._full(start_after)
        out = []
        with self._errors(f"listing {prefix or '/'}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(**kw):
                out += [(self._rel(o["Key"]), o["Size"]) for o in page.get("Contents", [])]
        out.sort(key=lambda kv: kv[0].encode())
        return out

    def children(self, prefix: str) -> builtins.list[str]:
        full = self._full(_check_prefix(prefix))
        names = set()
        with self._errors(f"listing {prefix or '/'}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=full, Delimiter="/"):
                names.update(o["Key"][len(full):] for o in page.get("Contents", []))
                names.update(p["Prefix"][len(full):].rstrip("/") for p in page.get("CommonPrefixes", []))
        return sorted((n for n in names if n), key=str.encode)

    def delete(self, key: str) -> None:
        with self._errors(f"deleting {key}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def _delete_many(self, keys: builtins.list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._k(k)} for k in keys[i:i + 1000]]
            with self._errors("deleting objects"):
                resp = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StorageError(f"storage {self.url}: deleting {self._rel(first['Key'])} failed: "
                                   f"{first.get('Code', 'error')}", url=self.url)

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        with self._errors(f"uploading {key}"):
            self.client.upload_file(os.fspath(path), self.bucket, self._k(key), Config=self.transfer)

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        with atomic_download(Path(path)) as (fd, tmp):
            os.close(fd)
            with self._errors(f"downloading {key}", key):
                self.client.download_file(self.bucket, self._k(key), tmp, Config=self.transfer)

    # ------------------------------------------------------------ the bucket
    def _bucket_exists(self) -> bool:
        try:
            with self._errors("checking the bucket"):
                self.client.head_bucket(Bucket=self.bucket)
        except BucketNotFoundError:
            return False
        return True

    def _create_bucket(self) -> None:
        region = self.client.meta.region_name or "us-east-1"
        kw = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        with self._errors("creating the bucket"):
            try:
                self.client.create_bucket(Bucket=self.bucket, **kw)
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                    raise

    def _delete_bucket(self) -> None:
        with self._errors("deleting the bucket"):
            self.client.delete_bucket(Bucket=self.bucket)
