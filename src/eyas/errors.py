"""The one exception type eyas raises for problems a user can fix.

Every message says what failed, why, and what to do, so the CLI can print it as-is without a traceback.
"""


class EyasError(Exception):
    """A user-facing error: `what` happened because `why`; `fix` says what to do."""

    def __init__(self, what: str, why: str = "", fix: str = ""):
        self.what, self.why, self.fix = what, why, fix
        parts = [what]
        if why:
            parts.append(f"why: {why}")
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("\n  ".join(parts))
