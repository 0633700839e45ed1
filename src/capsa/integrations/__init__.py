"""Adapters that let agent frameworks use capsa sessions, each behind an optional extra.

``capsa.integrations.langchain`` (``pip install 'capsa[langchain]'``): a LangChain deepagents sandbox
backend. ``capsa.integrations.openai_agents`` (``pip install 'capsa[openai-agents]'``): the OpenAI Agents
SDK's ``AsyncComputer`` on a session's browser (docs/browser.md). Each module imports its framework
itself, so importing this package needs nothing extra; the
adapters reach capsa only through the public SDK (``capsa.sdk``).
"""

from __future__ import annotations

__all__: list[str] = []
