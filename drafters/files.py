"""Writing files so that a crash or a bad input never leaves half a file or loses what was there before.

Every writer in draftsmith that replaces something (feature shards and indexes, exported checkpoints, the final
drafter of a run, built debug targets) goes through these two helpers: write under a temporary name next to the
destination, then rename into place (atomic on one filesystem). The model caches that several processes may build at
once (inference/assets.py, inference/debug_target.py) keep their own first-writer-wins rename instead: replacing a
directory another process may be reading is what they must not do.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from typing import Any, Iterator


def _temporary_name(path: str) -> str:
    """A unique hidden name next to `path` (same filesystem, so the final rename is atomic)."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_atomic(path: str, data: bytes | str) -> None:
    """Write `data` to `path` through a temporary file and a rename; readers see the old or the new file, never a
    partial one."""
    tmp = _temporary_name(path)
    try:
        with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json_atomic(path: str, data: Any, indent: int | None = None) -> None:
    write_atomic(path, json.dumps(data, indent=indent))


@contextlib.contextmanager
def replace_directory(final_dir: str) -> Iterator[str]:
    """Yield a fresh temporary directory next to `final_dir`; when the block succeeds it replaces `final_dir`, when it
    raises the temporary directory is removed and `final_dir` is left exactly as it was."""
    parent = os.path.dirname(os.path.abspath(final_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = _temporary_name(final_dir)
    os.makedirs(tmp_dir)  # not tempfile.mkdtemp: its 0700 mode would stick to the renamed directory
    try:
        yield tmp_dir
        old = None
        if os.path.isdir(final_dir):
            old = _temporary_name(final_dir)
            os.rename(final_dir, old)
        os.rename(tmp_dir, final_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
