"""The one exception type users see: its message is a complete, actionable sentence."""


class DFlashCacheError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 1."""


def first_line(error: Exception) -> str:
    """The first line of an exception's message (library errors can run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
