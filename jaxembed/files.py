"""Writing artefacts so that a reader, or a kill, sees the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, write) -> None:
    """write(binary file) into a temporary sibling, flushed to disk, then renamed over `path`: a
    reader (or a kill) sees the old file or the new one, complete, never a part. A symlink is written
    through (its target replaced), as open() would, not replaced by a plain file."""
    path = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # as a plain open() would make it (mkstemp's is 0600)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(Path(path), lambda f: f.write(text.encode("utf-8")))
