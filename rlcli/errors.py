"""The one exception type for mistakes a user can fix.

Anything raised as :class:`UserError` reaches the user as a plain message (no traceback) and the
CLI exits with code 2. The message must say what to change: the config key, file, row or setting.
"""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A mistake in the user's input (recipe, override, data file, command-line option)."""
