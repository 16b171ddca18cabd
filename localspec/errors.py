"""User-facing errors: one sentence that says what went wrong and what to do, never a traceback."""


class LocalspecError(Exception):
    """An error caused by the user's input or environment; the CLI prints it as one line."""
