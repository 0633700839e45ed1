"""Templates and where the node's sandboxes come from, by job.

:mod:`.store` keeps templates (snapshots of booted guests) in the storage pool and runs the warm-up
commands; :mod:`.build` builds a custom template from a spec (:mod:`.rootfs` installs its Debian packages on
the host); :mod:`.cache` keeps node-built templates beside the guest image; :mod:`.shipped` reads the specs
shipped with capsa (``specs/*.yaml``); :mod:`.source` makes the agent's session sandboxes (cold boot, or a
restore from a template through :mod:`.warm_pool`); :mod:`.warm` fills the template cache without a node
(``capsa template warm``, ``capsa image build``).
"""

__all__: list[str] = []
