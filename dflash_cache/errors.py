"""The one exception type users see: its message is a complete, actionable sentence."""


class DFlashCacheError(Exception):
    """A problem with the user's input or environment; the CLI prints it on one line and exits 1."""


def first_line(error: Exception) -> str:
    """The first line of an exception's message (library errors can run to pages)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# What reading a JSON file someone shared can raise: unreadable, not UTF-8, not JSON (ValueError
# covers JSONDecodeError), or nested so deep that the parser recurses past Python's limit.
JSON_FILE_ERRORS = (OSError, UnicodeDecodeError, ValueError, RecursionError)
