"""Shared plumbing for the recipes in ``recipes/``.

Only what two or more recipes use lives here: configuration, schedules, meters, EMA, run
plumbing (Accelerator, run folder, trackers, checkpoints, signals, non-finite guard) and data.
"""


class UserError(Exception):
    """Bad input from the user: printed as one ``error: ...`` line, exit status 2, no traceback."""
