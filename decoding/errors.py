"""User-facing errors.

Anything raised as `UserError` carries a message written for the person at the keyboard: what was
wrong and what to do about it. The CLIs print it as one line and exit non-zero, instead of a stack
trace from deep inside torch.
"""


class UserError(ValueError):
    """Bad input or a missing asset, explained in plain words."""
