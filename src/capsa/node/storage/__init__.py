"""Node storage: the copy-on-write pool for templates, sandbox disks, memory files and snapshots."""

from capsa.node.storage.filecopy import CopyError, ReflinkUnsupported, copy_file, reflink, sparse_copy
from capsa.node.storage.pool import PoolUsage, StorageError, StoragePool, StorageSettings

__all__ = [
    "CopyError",
    "PoolUsage",
    "ReflinkUnsupported",
    "StorageError",
    "StoragePool",
    "StorageSettings",
    "copy_file",
    "reflink",
    "sparse_copy",
]
