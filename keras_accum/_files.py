"""Files `AccumModel` writes: whole or not at all.

Keras writes a `.keras` or `.weights.h5` file in place, so a process
killed during the write (pre-emption, out of memory, a kill signal) leaves
a torn file behind; for `BackupAndRestore` that is its only backup, and
every restart then fails to open it. `AccumModel.save` and `save_weights`
write beside the target and rename onto it once the file is complete: a
kill leaves the previous file intact.
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def replaced_whole(filepath, suffix: str, overwrite: bool = True):
    """Yields where to write `filepath`; renames it there when complete.

    Args:
        filepath: The target path.
        suffix: The extension Keras requires of the path
            (`".weights.h5"`, `".keras"`); the temporary name keeps it.
        overwrite: As Keras's argument. When False and the target exists,
            the target itself is yielded so that Keras asks, as it does.

    Paths on remote filesystems (`gs://...`), paths with another ending
    and, when not overwriting, existing targets are yielded unchanged:
    written as Keras writes them.
    """
    path = os.fspath(filepath) if isinstance(filepath, os.PathLike) else None
    if isinstance(filepath, str):
        path = filepath
    if (
        path is None
        or "://" in path
        or not path.endswith(suffix)
        or (not overwrite and os.path.exists(path))
    ):
        yield filepath
        return
    directory, name = os.path.split(path)
    partial = os.path.join(
        directory,
        f".{name[: -len(suffix)]}.partial-{os.getpid()}{suffix}",
    )
    try:
        yield partial
        # On disk before the rename, so that a power cut cannot leave a
        # renamed but empty file either.
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
