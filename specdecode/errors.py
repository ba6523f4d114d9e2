"""The user-error base: anything a user can fix by changing what they typed or passed.

Commands raise a subclass of :class:`UserError` for bad input; the command line turns it into one
line on stderr and exit status 2 (``specdecode.cli``), never a traceback. Bugs stay tracebacks.
"""


class UserError(Exception):
    """Bad input: a missing file, an unknown name, a bad flag value, an incompatible model."""
