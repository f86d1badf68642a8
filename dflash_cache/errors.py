"""The one exception type users see: its message is a complete, actionable sentence."""


class DFlashCacheError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 1."""
