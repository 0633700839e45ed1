"""Adapters that let agent frameworks use capsa sessions, each behind an optional extra.

``capsa.integrations.langchain`` (``pip install 'capsa[langchain]'``): a LangChain deepagents sandbox
backend. Each module imports its framework itself, so importing this package needs nothing extra; the
adapters reach capsa only through the public SDK (``capsa.sdk``).
"""

from __future__ import annotations

__all__: list[str] = []
