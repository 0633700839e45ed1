"""The node's side of the guest channel: the client of the capsa guest daemon (capsa.guest), by job.

:mod:`.connection` frames, routes and bounds calls; :mod:`.streams` is one call's flow control;
:mod:`.client` holds the operations; :mod:`.handles` the long-lived ones (terminal, port tunnel, output
stream, directory watch); :mod:`.identity` what a sandbox is told when it is bound; :mod:`.facade` what the
node API calls for a sandbox. The results the guest sends are declared once, in :mod:`capsa.guest.results`.
"""
