"""User-facing errors: the CLI prints the message as one paragraph and exits 2, without a traceback."""


class SparsifyError(Exception):
    """A problem with the user's input or environment, with a message that says how to fix it."""
