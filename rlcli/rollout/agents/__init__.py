"""Agents written against the OpenAI API as rollouts (``rollout.agent``; docs/agentic.md): the
OpenAI-compatible endpoint in front of a replica's engine (``server``, ``routes``), the chat
requests as token ids (``chat``), exact token capture (``capture``) and the agents' runner
(``runner``)."""
