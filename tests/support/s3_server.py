"""A real S3 server for the tests: OpenStack Swift 2.30 (Debian's packages) with its s3api middleware.

One replica of each ring (account, container, object) over a plain directory, the four servers bound to
127.0.0.1 on free ports, tempauth with one admin user (access key ``test:tester``, secret ``testing``). The
proxy pipeline needs ``copy``, ``slo`` and ``dlo`` for S3 multipart uploads. Everything lives in a temporary
directory; the servers are stopped (SIGTERM, then SIGKILL) and the directory removed afterwards.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["S3Server", "s3_missing_reason", "temporary_s3"]

_KINDS = ("account", "container", "object")
_PROXY_FILTERS = {
    "catch_errors": "catch_errors", "gatekeeper": "gatekeeper", "proxy-logging": "proxy_logging",
    "cache": "memcache", "listing_formats": "listing_formats", "s3api": "s3api", "copy": "copy", "slo": "slo",
    "dlo": "dlo",
}
_PIPELINE = ("catch_errors gatekeeper proxy-logging cache listing_formats s3api tempauth copy slo dlo "
             "proxy-logging proxy-server")


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str = "test:tester"
    secret_key: str = "testing"

    def env(self) -> dict[str, str]:
        """The variables a capsa process needs to use a bucket of this server as its store."""
        return {"CAPSA_STORE_S3_ENDPOINT": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1").create_bucket(Bucket=name)


def s3_missing_reason() -> str | None:
    for kind in (*_KINDS, "proxy"):
        if shutil.which(f"swift-{kind}-server") is None:
            return f"swift-{kind}-server not found (apt install swift-{kind})"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf(root: Path, port: int, pipeline: str, apps: str) -> str:
    return (f"[DEFAULT]\nbind_ip = 127.0.0.1\nbind_port = {port}\nswift_dir = {root}\n"
            f"devices = {root / 'srv'}\nmount_check = false\nuser = root\nworkers = 0\n"
            f"log_level = WARNING\n\n"
            f"[pipeline:main]\npipeline = {pipeline}\n\n{apps}")


def _write_confs(root: Path, ports: dict[str, int]) -> None:
    for kind in _KINDS:
        builder = str(root / f"{kind}.builder")
        device = f"r1z1-127.0.0.1:{ports[kind]}/d1"
        for args in (["create", "10", "1", "1"], ["add", device, "1"], ["rebalance"]):
            subprocess.run(["swift-ring-builder", builder, *args], check=True, capture_output=True,
                           timeout=60)
        (root / f"{kind}-server.conf").write_text(
            _conf(root, ports[kind], f"{kind}-server", f"[app:{kind}-server]\nuse = egg:swift#{kind}\n"))
    filters = "".join(f"[filter:{name}]\nuse = egg:swift#{egg}\n\n" for name, egg in _PROXY_FILTERS.items())
    apps = ("[app:proxy-server]\nuse = egg:swift#proxy\naccount_autocreate = true\n\n" + filters
            + "[filter:tempauth]\nuse = egg:swift#tempauth\nuser_test_tester = testing .admin\n")
    (root / "proxy-server.conf").write_text(_conf(root, ports["proxy"], _PIPELINE, apps))


def _wait_up(endpoint: str, procs: list[subprocess.Popen[bytes]], root: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/info", timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer: the proxy serves
        except OSError:
            dead = [p.pid for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f.read_text()[-2000:] for f in root.glob("*.log"))
                raise RuntimeError(f"the S3 server did not start (exited: {dead})\n{logs}") from None
            time.sleep(0.1)


@contextlib.contextmanager
def temporary_s3() -> Iterator[S3Server]:
    root = Path(tempfile.mkdtemp(prefix="capsa-s3-"))
    (root / "srv" / "d1").mkdir(parents=True)
    ports = {kind: _free_port() for kind in (*_KINDS, "proxy")}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _write_confs(root, ports)
        for kind in (*_KINDS, "proxy"):
            log = (root / f"{kind}.log").open("wb")
            procs.append(subprocess.Popen([f"swift-{kind}-server", str(root / f"{kind}-server.conf")],
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        endpoint = f"http://127.0.0.1:{ports['proxy']}"
        _wait_up(endpoint, procs, root)
        yield S3Server(endpoint)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(root, ignore_errors=True)
