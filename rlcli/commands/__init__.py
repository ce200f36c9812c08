"""Every ``rlcli`` command, one module per command group; ``rlcli.cli`` assembles them."""
