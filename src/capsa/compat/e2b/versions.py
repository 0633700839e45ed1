"""The envd version capsa reports to the E2B SDK, which gates SDK features by it.

0.5.7: octet-stream uploads, ``CloseStdin`` and the default user (so the SDK sends no user unless the caller
names one). Below 0.6.2, so the SDK refuses file metadata (xattrs, not kept by capsa) itself with a clear
message, and below 0.6.3, so watch events carry no entry info.
"""

__all__ = ["ENVD_VERSION"]

ENVD_VERSION = "0.5.7"
