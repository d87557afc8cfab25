"""The one exception type eyas raises for problems a user can fix.

Every message says what failed, why, and what to do, so the CLI can print it as-is without a traceback.
"""

import errno
import re


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


class Incomplete(EyasError):
    """A stage stopped before the end with its completed work kept (the CLI exits 3): `summary` is what it did,
    `fix` the command that resumes it."""

    def __init__(self, what: str, why: str, fix: str, summary: dict):
        super().__init__(what, why, fix)
        self.summary = summary


_UNWRITABLE = {errno.EACCES: "permission denied", errno.EPERM: "the operation is not permitted there",
               errno.EROFS: "the file system is read-only"}


def unwritable(e: BaseException) -> EyasError | None:
    """The clear error for a write refused by the file system (a read-only folder or mount, another user's
    folder), naming the path; None for any other error."""
    why = _UNWRITABLE.get(getattr(e, "errno", None))
    path = getattr(e, "filename", None)
    if why is None or path is None:
        return None
    return EyasError(f"cannot write {path}: {why}", "the output goes to a place this process may not write",
                     "choose an output path in a writable folder (--out, --store), or make that folder writable")


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
              errno.EFBIG: "the file size limit is reached (ulimit -f, or the file system's largest file)"}


def disk_full(e: BaseException) -> str | None:
    """Why a write failed when it is for want of room (ENOSPC, EDQUOT, EFBIG, also inside a safetensors error), else
    None: the errors a user fixes by freeing space rather than by changing anything in eyas."""
    code = getattr(e, "errno", None)
    if code is None:  # safetensors' Rust writer: "... I/O error: No space left on device (os error 28)"
        m = re.search(r"\(os error (\d+)\)", str(e))
        code = int(m.group(1)) if m else None
    return _DISK_FULL.get(code)


_NOT_A_PLACE = {errno.ENOTDIR: "a part of that path is a file, not a folder",
                errno.EEXIST: "a file of that name is in the way", errno.EISDIR: "it is a folder, not a file",
                errno.ENOENT: "it does not exist (or a link on the way points nowhere)",
                errno.ELOOP: "links on that path point at each other"}


def os_failure(e: BaseException) -> EyasError | None:
    """The clear error for a file-system failure a stage did not expect, naming the path: a write refused
    (`unwritable`), a disk full, a file where a folder goes. None for an error without a path or another cause."""
    if (err := unwritable(e)) is not None:
        return err
    path = getattr(e, "filename", None)
    if (why := disk_full(e)) is not None:
        return EyasError(f"cannot write {path or 'the output'}: {why}", "the output's disk is full",
                         "free space on that disk (or write elsewhere), then rerun the same command: completed work "
                         "is kept")
    why = _NOT_A_PLACE.get(getattr(e, "errno", None))
    if why is None or path is None:
        return None
    return EyasError(f"cannot use {path}: {why}", f"{type(e).__name__}: {getattr(e, 'strerror', '') or e}",
                     "give an output path in an existing folder, with no file or broken link in its way")
