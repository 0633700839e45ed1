"""``capsa doctor``: what a host needs before a node runs on it, each checked for real and reported with a
one-line fix; ``capsa node`` runs the same checks at start and refuses with the first that fails.

:mod:`~capsa.node.doctor.report` holds the result type and what the checks read,
:mod:`~capsa.node.doctor.run` the runner (the order of the checks),
:mod:`~capsa.node.doctor.host` the checks of the machine (accelerator, QEMU, btrfs, nftables, cgroups, the
VM user), :mod:`~capsa.node.doctor.paths` those of the state directory (traversal by the VM user, free
space) and :mod:`~capsa.node.doctor.remote` those of the services a node talks to (the store, the control
plane). Every check uses the probe the node itself uses (the runtime's accelerator decision and its cache,
QEMU's isolation prefix, the sandbox nftables ruleset), so a passing check means the node's own step works.
"""

from capsa.node.doctor.report import Check, DoctorConfig
from capsa.node.doctor.run import first_failure, run_checks

__all__ = ["Check", "DoctorConfig", "first_failure", "run_checks"]
