"""The node's side of the guest channel: the client of the capsa guest daemon (capsa.guest), by job.

:mod:`.connection` frames, routes and bounds calls; :mod:`.streams` is one call's flow control;
:mod:`.client` holds the operations; :mod:`.handles` the long-lived ones (terminal, port tunnel, output
stream, directory watch); :mod:`.identity` what a sandbox is told when it is bound. What the node API calls
for a sandbox is the agent's (:mod:`capsa.node.agent.guest`). The results the guest sends are declared once,
in :mod:`capsa.guest.results`. The package imports nothing else of the node: the runtime builds its clients.
"""
