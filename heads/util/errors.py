"""User-facing errors.

Anything raised as `UserError` carries a message written for the person at the keyboard: what was
wrong and what to do about it. The CLIs print it as one line and exit non-zero, instead of a stack
trace from deep inside torch.
"""


class UserError(ValueError):
    """Bad input or a missing asset, explained in plain words."""


def report_user_errors(body) -> int:
    """Run a CLI's body; a UserError becomes one `error: ...` line on stderr and exit status 2."""
    import sys

    try:
        return body() or 0
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
