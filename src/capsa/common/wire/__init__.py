"""The public API's bodies that the control plane serves and the SDK parses, declared once, a module per
feature (``/v1/audit``, ``/v1/approvals``, egress, connections); :mod:`capsa.common.wire.base` holds what
they share. The SDK's names for them (``AuditRecord``, ``ApprovalInfo``, ...) are these classes."""
