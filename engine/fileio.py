"""Writing files safely: the one place that does temp-file-and-rename.

    with atomic_write("out/x.safetensors") as tmp:      # any writer that takes a path
        save_file(tensors, str(tmp))
    write_json_atomic("out/x.json", {"a": 1})
    claim_names([a, b])                                  # exclusive create of several names, or none

- A file appears complete or not at all: bytes go to ``.<name>.tmp-<pid>-<hex>`` in the
  target's folder (same filesystem, so the rename is atomic), are fsynced, then renamed;
  the folder is fsynced so the rename survives a power cut.
- Files get the ordinary mode the umask gives (0644 typically). safetensors' writer
  and ``mkstemp`` create 0600, which left saved LoRAs unreadable to other users.
- ``overwrite=False`` never replaces an existing file, even one created by another
  process between our check and our rename (a hard link is the atomic no-clobber rename).
- A process killed mid-write leaves its temp file behind; ``clean_stale_temps`` removes
  ours whose writer is gone (the pid in the name no longer runs).
- OS errors (read-only folder, full disk, a file where a folder should be, a name too
  long) become a ``StorageError`` that says what was being written, where, and the fix.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import threading
from pathlib import Path
from typing import Iterator

from .errors import StorageError

# Our temp names: ".<name>.tmp-<pid>" (older builds) or ".<name>.tmp-<pid>-<hex>", maybe + ".png".
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)(?:-[0-9a-f]{8})?(?:\.png)?$")
_umask_lock = threading.Lock()


def temp_path_for(path: str | Path) -> Path:
    """A fresh temp name beside ``path`` (same folder: same filesystem, atomic rename). The
    suffix is kept, so writers that pick a format from it (PIL) still work."""
    path = Path(path)
    suffix = path.suffix if path.suffix in (".png", ".jpg") else ""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def default_file_mode() -> int:
    """0o666 minus the process umask: what ``open(..., "w")`` would create."""
    try:  # Linux: read it without changing it (os.umask is process-global and racy)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def explain_os_error(exc: BaseException, what: str, where: str | Path) -> StorageError:
    """A StorageError naming ``what`` was being written, ``where``, why, and the fix."""
    where = str(where)
    code = getattr(exc, "errno", None)
    if isinstance(exc, ValueError) and "null" in str(exc).lower():
        why, fix = "the name contains a NUL byte", "remove the NUL character from the name/prefix"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        why, fix = "the folder is not writable", ("pick a writable folder (e.g. --output-dir, or ComfyUI's "
                                                  "--output-directory), or fix the folder's permissions")
    elif code in (errno.ENOSPC, errno.EDQUOT):
        why, fix = "the disk is full (or over quota)", "free space on that disk or write to another one"
    elif code == errno.ENAMETOOLONG:
        why, fix = "a file or folder name is too long", "use a shorter name/prefix (at most ~200 characters per part)"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        why, fix = ("a part of the path is a file where a folder is needed",
                    "move or rename that file, or pick another path")
    elif code == errno.EISDIR:
        why, fix = "a folder is in the way of the file", "move or rename that folder, or pick another name"
    else:
        why, fix = f"{type(exc).__name__}: {exc}", "check the path and the disk"
    if code is not None and why != f"{type(exc).__name__}: {exc}":
        why += f" ({os.strerror(code)})"
    return StorageError(f"cannot write {what} at '{where}': {why}; {fix}")


def ensure_dir(folder: str | Path, what: str = "files") -> Path:
    """``mkdir -p`` with an explained error (a file in the way, read-only, full, too long)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        raise explain_os_error(exc, what, folder) from None
    if not folder.is_dir():
        raise explain_os_error(OSError(errno.ENOTDIR, "not a folder"), what, folder)
    return folder


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails if path exists, even if it appeared a moment ago
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links (FAT, some shares): best effort
        if path.exists():
            raise FileExistsError(errno.EEXIST, "exists", str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


@contextlib.contextmanager
def atomic_write(path: str | Path, what: str = "a file", overwrite: bool = True) -> Iterator[Path]:
    """Yield a temp path to write; on success it becomes ``path`` (fsynced, mode from the
    umask). On any error the temp file is removed and ``path`` is untouched. With
    ``overwrite=False`` an existing ``path`` raises FileExistsError."""
    path = Path(path)
    ensure_dir(path.parent, what)
    tmp = temp_path_for(path)
    try:
        try:
            yield tmp
            os.chmod(tmp, default_file_mode())
            _fsync_file(tmp)
            _publish(tmp, path, overwrite)
        except (FileExistsError, StorageError):
            raise
        except (OSError, ValueError) as exc:
            if isinstance(exc, ValueError) and "null" not in str(exc).lower():
                raise
            raise explain_os_error(exc, what, path) from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    _fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes, what: str = "a file", overwrite: bool = True) -> Path:
    with atomic_write(path, what, overwrite) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | Path, text: str, what: str = "a file", overwrite: bool = True) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"), what, overwrite)


def write_json_atomic(path: str | Path, obj, what: str = "a JSON file", indent: int | None = 1) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=str), what)


def claim_names(paths: list[Path], what: str = "an output file") -> bool:
    """Create every one of ``paths`` exclusively (as empty files), or none: True when all
    were ours to take. Two processes can never both claim a name, so two runs saving to
    the same folder never overwrite each other; the caller then writes over its own
    empty files (``overwrite=True``) and removes them if saving fails."""
    taken: list[Path] = []
    try:
        for p in paths:
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            os.close(fd)
            taken.append(p)
        return True
    except FileExistsError:
        for p in taken:
            with contextlib.suppress(OSError):
                p.unlink()
        return False
    except (OSError, ValueError) as exc:
        for p in taken:
            with contextlib.suppress(OSError):
                p.unlink()
        raise explain_os_error(exc, what, paths[len(taken)]) from None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or we cannot tell: keep its file
    return True


def clean_stale_temps(folder: str | Path, name: str | None = None) -> list[Path]:
    """Remove our temp files in ``folder`` (of target ``name`` only, if given) whose writing
    process is gone, e.g. a slab build killed with SIGKILL. Returns what was removed."""
    folder = Path(folder)
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        m = _TEMP_RE.match(entry.name)
        if m is None or (name is not None and m["name"] != name) or not entry.is_file():
            continue
        if _pid_alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry)
    return removed
