"""One exception type for every user-facing failure.

The CLI prints ``TrtkvError`` as a single line (problem, then fix) and exits non-zero;
anything else is a bug and keeps its traceback.
"""


class TrtkvError(Exception):
    """A problem with the user's input or environment, with the fix in the message."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} — {fix}" if fix else problem)
