"""Environments: multi-turn interaction without tools. After each assistant turn the environment
answers with a user message, whether the trajectory is done, and optionally a reward.

``rlcli.environments.base`` holds the interface and the registry (built-ins by name, user
environments as ``module:Class`` or ``path/file.py:Class``); ``running_sum`` is the built-in
example, a multi-step addition dialogue sized for the quickstart model.
"""
