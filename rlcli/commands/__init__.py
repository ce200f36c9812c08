"""Typer sub-apps that rlcli.cli mounts (``rlcli launch ...``)."""
