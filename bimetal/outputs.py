"""Where a command writes: every output location checked before work starts, and files written whole.

A run can only lose its work at the end if a folder it writes is found unwritable then (the checkpoint after
all the steps, the export after the last). So every command checks each location it will write *before*
anything starts - ``check_folder`` for a folder (run folder, checkpoint folder, export folder, a benchmark's
``--out``) and ``check_file`` for a file (``plan --write``) - and refuses one that cannot be created or written
in one sentence naming the setting and the path. The checks write nothing that stays: a folder that does not
exist yet is not created, its nearest existing parent is probed instead, with a file created and removed
at once (the only test that also holds for root, for read-only mounts, ACLs and network file systems).

``write_text`` writes a file beside its target and renames it into place, so a reader (or a crash) sees
the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from bimetal.errors import UserError


def _probe(folder: Path) -> str | None:
    """Why no file can be created in the existing folder ``folder``, or None when one can (and was removed)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".bimetal-probe-")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def _nearest(path: Path) -> tuple[Path, Path | None]:
    """(the deepest existing ancestor of ``path``, or ``path`` itself; the first missing component under it)."""
    missing = None
    current = path
    while not current.exists() and not current.is_symlink():
        missing = current
        if current.parent == current:
            break
        current = current.parent
    return current, missing


def folder_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be used as an output folder (created if missing, files written in it), or None."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    try:
        existing, missing = _nearest(p)
    except OSError as exc:  # a folder on the way that cannot be searched
        return f"{p} cannot be reached ({exc.strerror or type(exc).__name__})"
    if existing.is_symlink() and not existing.exists():
        return f"{existing} is a link to nothing"
    if not existing.is_dir():
        return f"{existing} is a file, not a folder" if existing == p else \
            f"{existing} is a file, so no folder can be made under it"
    if missing is not None and not os.access(existing, os.X_OK):
        return f"{existing} cannot be entered (Permission denied)"
    why = _probe(existing)
    if why is None:
        return None
    return f"{existing} is not writable ({why})" if existing == p else \
        f"it would be made in {existing}, which is not writable ({why})"


def check_folder(key: str, path: str | Path) -> None:
    """Refuse, naming ``key``, an output folder that cannot be created or written; creates nothing."""
    why = folder_problem(path)
    if why is not None:
        raise UserError(f"{key}={str(path)!r} cannot be written: {why}; choose a folder you can write to.")


def check_file(key: str, path: str | Path) -> None:
    """Refuse, naming ``key``, an output file that cannot be written (its folder is created if missing)."""
    p = Path(os.path.abspath(os.path.expanduser(str(path))))
    try:
        is_dir, exists = p.is_dir(), p.exists()
    except OSError:
        is_dir = exists = False  # the folder check below says why it cannot be reached
    if str(path).endswith(os.sep) or is_dir:
        raise UserError(f"{key}={str(path)!r} is a folder; give the path of a file to write.")
    why = folder_problem(p.parent)
    if why is None and exists:
        try:  # an existing file is replaced by a rename, so only its folder must be writable; read-only is kept
            writable = os.access(p, os.W_OK)
        except OSError:
            writable = False
        why = None if writable else f"{p} is read-only"
    if why is not None:
        raise UserError(f"{key}={str(path)!r} cannot be written: {why}; choose a path you can write to.")


def umask() -> int:
    """This process's umask (read by setting it and back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mode(path: Path) -> int:
    """The permission bits a file written at ``path`` gets: those of the file it replaces, else the umask's."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        return 0o666 & ~umask()


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole: into a temporary file beside it, then renamed over it."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), _mode(p))
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def scratch_run_folder(path: str | Path) -> Path:
    """``path`` emptied for one training run a benchmark starts in a folder of its own naming: what an earlier
    benchmark left there (its records, its final checkpoint) is that benchmark's scratch, and ``bimetal train``
    refuses a run that is not a resume where checkpoints already are. Never for a folder the user named."""
    p = Path(path)
    shutil.rmtree(p, ignore_errors=True)
    return p
