"""The S3 backend (AWS S3, MinIO, Ceph RGW, R2, OpenStack Swift's s3api), through boto3.

``s3://bucket/prefix`` with ``CAPSA_STORE_S3_ENDPOINT`` for anything but AWS, and the usual AWS credential
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles). boto3 does
the retries (standard mode, 5 attempts) and the multipart transfers of large files (s3transfer: parts of
16 MiB above 16 MiB, 4 at a time). Single puts carry a Content-MD5 the server checks; the snapshot layer
above checks a SHA-256 of every chunk it reads back, so a corrupt object is noticed end to end. Path-style
addressing and checksums only "when required": S3-compatible servers differ on virtual hosts and on the
newer CRC checksum headers, and these settings work on all of them.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from capsa.store.objects import ObjectInfo, ObjectMissing, StoreError, check_key

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

__all__ = ["S3Store"]

_MISSING = {"NoSuchKey", "404", "NotFound"}
_PART = 16 * 1024 * 1024


class S3Store:
    def __init__(self, bucket: str, prefix: str = "", *, endpoint: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.url = f"s3://{bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")
        config = Config(retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": "path"},
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required",
                        connect_timeout=10, read_timeout=60, max_pool_connections=16)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._client: S3Client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region, config=config)
        self._transfer = TransferConfig(multipart_threshold=_PART, multipart_chunksize=_PART,
                                        max_concurrency=4, use_threads=True)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, e: Exception, what: str, key: str) -> StoreError:
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            if err.get("Code") in _MISSING:
                return ObjectMissing(f"no object {key} in {self.url}")
            detail = f"{err.get('Code')} {err.get('Message', '')}".strip()
            return StoreError(f"{what} {key} in {self.url}: {detail}")
        return StoreError(f"{what} {key} in {self.url}: {e}")

    def put(self, key: str, data: bytes) -> None:
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, ContentMD5=md5)
        except (BotoCoreError, ClientError) as e:
            raise self._fail(e, "cannot write", key) from e

    def put_file(self, key: str, path: Path) -> None:
        try:
            self._client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)
        except (BotoCoreError, ClientError) as e:
            raise self._fail(e, "cannot write", key) from e
        except Exception as e:  # s3transfer wraps a failed part in its own exception types
            raise StoreError(f"cannot write {key} in {self.url}: {e}") from e

    def get(self, key: str) -> bytes:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except (BotoCoreError, ClientError) as e:
            raise self._fail(e, "cannot read", key) from e

    def get_file(self, key: str, path: Path) -> None:
        tmp = path.with_name(path.name + ".part")
        try:
            self._client.download_file(self.bucket, self._key(key), str(tmp), Config=self._transfer)
        except (BotoCoreError, ClientError) as e:
            tmp.unlink(missing_ok=True)
            raise self._fail(e, "cannot read", key) from e
        os.replace(tmp, path)

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return False
            raise self._fail(e, "cannot read", key) from e
        except BotoCoreError as e:
            raise self._fail(e, "cannot read", key) from e
        return True

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (BotoCoreError, ClientError) as e:
            err = self._fail(e, "cannot delete", key)
            if not isinstance(err, ObjectMissing):
                raise err from e

    def list(self, prefix: str) -> list[ObjectInfo]:
        if prefix.strip("/"):
            full = self._key(prefix.rstrip("/")) + "/"
        else:
            full = f"{self.prefix}/" if self.prefix else ""
        cut = len(self.prefix) + 1 if self.prefix else 0
        out: list[ObjectInfo] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(obj["Key"][cut:], obj["Size"], obj["LastModified"].timestamp()))
        except (BotoCoreError, ClientError) as e:
            raise self._fail(e, "cannot list", prefix or "/") from e
        return out

    def check(self) -> str:
        """The bucket answers a HEAD with these credentials (it exists and they may use it)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            err = e.response.get("Error", {})
            raise StoreError(f"bucket {self.bucket} at {self.url}: HEAD answered {err.get('Code')} "
                             f"{err.get('Message', '')}".rstrip()) from e
        except BotoCoreError as e:
            raise StoreError(f"bucket {self.bucket} at {self.url} unreachable: {e}") from e
        return f"bucket {self.bucket} answered HEAD"
