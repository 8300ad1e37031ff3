"""Writing files so that a crash or a bad input never leaves half a file or loses what was there before.

Every writer in draftsmith that replaces something (feature shards and indexes, exported checkpoints, the final
drafter of a run, built debug targets) goes through these two helpers: write under a temporary name next to the
destination, then rename into place (atomic on one filesystem). The model caches that several processes may build at
once (inference/assets/store.py, inference/assets/debug_target.py) keep their own first-writer-wins rename instead: replacing a
directory another process may be reading is what they must not do.

A full disk (ENOSPC, or a quota: EDQUOT) is a user's problem, not a bug: `disk_full_reported` turns it into a
`DiskFullError` whose one-line message names the path and what to do, after the temporary file or directory is gone
(so the space it held is free again and the destination keeps its previous content).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Iterator


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """No space left while writing `path`. `str()` is the one line a user reads (no errno prefix)."""

    def __init__(self, path: str, remedy: str):
        self.message = f"no space left on device writing {path}: free space there or {remedy}"
        super().__init__(errno.ENOSPC, self.message, path)

    def __str__(self) -> str:
        return self.message


def check_writable_dir(path: str, field: str) -> None:
    """ValueError naming `field` when directory `path` could not be written: it exists and is not a directory, or
    its nearest existing ancestor is not a directory this process can create entries in (tried: an empty
    directory made and removed there, since permission bits do not bind root and some filesystems refuse anyway).
    Leaves nothing behind (on several nodes each rank checks its own disk), so a bad output path fails before any
    model loads."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe != os.path.abspath(path) and not os.path.isdir(probe):
        raise ValueError(f"{field}: {path} cannot be created: {probe} is a file; choose another path")
    if not os.path.isdir(probe):
        raise ValueError(f"{field}: {path} is a file, not a directory; choose another path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".draftsmith-write-check-", dir=probe))
    except OSError as err:
        raise ValueError(f"{field}: {path} cannot be written ({probe}: {(err.strerror or str(err)).lower()}); "
                         "choose another path") from None


@contextlib.contextmanager
def disk_full_reported(path: str, remedy: str = "choose another output directory") -> Iterator[None]:
    """Inside the block, ENOSPC/EDQUOT raised by any write becomes a DiskFullError naming `path` (the destination,
    not the temporary name the OS saw) and `remedy`. An inner DiskFullError keeps its path and takes this block's
    remedy: the outer caller knows which setting to change. Other errors pass through unchanged."""
    try:
        yield
    except OSError as err:
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise DiskFullError(err.filename if isinstance(err, DiskFullError) else path, remedy) from None


def _temporary_name(path: str) -> str:
    """A unique hidden name next to `path` (same filesystem, so the final rename is atomic)."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_atomic(path: str, data: bytes | str) -> None:
    """Write `data` to `path` through a temporary file and a rename; readers see the old or the new file, never a
    partial one."""
    tmp = _temporary_name(path)
    try:
        with disk_full_reported(path), open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path: str, data: Any, indent: int | None = None) -> None:
    write_atomic(path, json.dumps(data, indent=indent))


@contextlib.contextmanager
def replace_directory(final_dir: str, keep: Callable[[str], bool] | None = None) -> Iterator[str]:
    """Yield a fresh temporary directory next to `final_dir`; when the block succeeds it replaces `final_dir`, when it
    raises the temporary directory is removed and `final_dir` is left exactly as it was (a full disk is reported
    as a DiskFullError naming `final_dir`).

    keep: for a cache that several processes may fill at once with the same content (DDP ranks building one
    model): a `final_dir` that keep(final_dir) accepts as complete is left in place and ours is discarded, so a
    process already reading it never sees it replaced."""
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = _temporary_name(final_dir)
    os.makedirs(tmp_dir)  # not tempfile.mkdtemp: its 0700 mode would stick to the renamed directory
    try:
        with disk_full_reported(final_dir):
            yield tmp_dir
        if keep is not None and keep(final_dir):
            return
        old = None
        if os.path.isdir(final_dir):
            old = _temporary_name(final_dir)
            os.rename(final_dir, old)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:  # another process renamed its complete copy into place first
            if keep is None or not keep(final_dir):
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
