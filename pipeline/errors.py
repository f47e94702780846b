"""Errors a user can fix: the CLI prints their message in one line, without a traceback."""


class StageError(Exception):
    """A stage cannot go on because of its inputs (missing data, bad params, a failed gate...)."""
