"""Checks of what a node talks to: the fleet's store (``CAPSA_STORE_URL``) and the control plane
(``CAPSA_CONTROL_URL``). A setting that is absent is reported as ok, with "not configured" in the detail."""

from __future__ import annotations

import asyncio
import time

import httpx

from capsa.node.doctor.report import Check, DoctorConfig
from capsa.store import StoreError, open_store

__all__ = ["control_plane", "store"]

_TIMEOUT = 5.0


async def store(cfg: DoctorConfig) -> Check:
    """The store can be used: a directory store is writable, an S3 bucket answers a HEAD."""
    url = cfg.settings.store_url
    if not url:
        return Check("store", True, "not configured (CAPSA_STORE_URL unset): snapshots and templates stay on "
                                    "this node")
    try:
        opened = await asyncio.to_thread(open_store, url, s3_endpoint=cfg.settings.store_s3_endpoint)
        found = await asyncio.to_thread(opened.check)
    except StoreError as exc:
        return Check("store", False, str(exc),
                     "check CAPSA_STORE_URL (file:///dir on a shared mount, or s3://bucket/prefix with "
                     "CAPSA_STORE_S3_ENDPOINT and AWS_* credentials)")
    return Check("store", True, f"{opened.url}: {found}")


async def control_plane(cfg: DoctorConfig) -> Check:
    """``GET /v1/health`` of the control plane answers 200."""
    if not cfg.control_url:
        return Check("control_plane", True, "not configured (CAPSA_CONTROL_URL unset, no --control-url)")
    url = cfg.control_url.rstrip("/") + "/v1/health"
    fix = "start capsa control there, or fix CAPSA_CONTROL_URL (--control-url) and the route to it"
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=_TIMEOUT) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        return Check("control_plane", False, f"{url} unreachable: {exc or type(exc).__name__}", fix)
    took = (time.monotonic() - started) * 1000
    if response.status_code != 200:
        return Check("control_plane", False, f"{url} answered {response.status_code}", fix)
    return Check("control_plane", True, f"{url} answered 200 in {took:.0f} ms")
