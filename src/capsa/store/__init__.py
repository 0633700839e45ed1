"""The fleet's shared store of snapshots and templates (``CAPSA_STORE_URL``).

One interface (:class:`~capsa.store.objects.ObjectStore`: put, get, list, delete of named objects) with two
backends: S3-compatible object storage (:mod:`capsa.store.s3`) and a directory (:mod:`capsa.store.directory`,
a shared mount such as NFS, or a local directory on one host). :mod:`capsa.store.chunks` and
:mod:`capsa.store.bundles` lay snapshots out on it: files cut into content-addressed chunks, so what two
snapshots share (a template's disk, the RAM pages an idle session did not touch) is stored and shipped once.

A leaf: it imports only :mod:`capsa.common`; the control plane and the node both use it.
"""

from capsa.store.config import open_store, store_from_settings
from capsa.store.objects import ObjectInfo, ObjectMissing, ObjectStore, StoreError

__all__ = ["ObjectInfo", "ObjectMissing", "ObjectStore", "StoreError", "open_store", "store_from_settings"]
