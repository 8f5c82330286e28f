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
  long) become a ``StorageError`` that says what was being written, where, and the fix;
  so do the same errors inside writers that report them as their own exception
  (safetensors' ``SafetensorError: ... I/O error: No space left on device (os error 28)``).
  A full disk names the folder, its free bytes and what the file needed (``size``, when
  the caller knows it; else at least what was written before the disk filled).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
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


#: How writers in other libraries spell an OS error inside their own exception: Rust's io::Error
#: ("... (os error 28)", safetensors) or the C library's text.
_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")
_OS_ERROR_TEXT = {"no space left on device": errno.ENOSPC, "disk quota exceeded": errno.EDQUOT,
                  "read-only file system": errno.EROFS, "permission denied": errno.EACCES}


def os_errno_of(exc: BaseException) -> int | None:
    """The OS error code behind ``exc``: its ``errno``, or one named in the message of a writer that wraps
    OS errors in its own exception type (safetensors' SafetensorError). None when there is none."""
    code = getattr(exc, "errno", None)
    if code is not None:
        return code
    text = str(exc)
    m = _OS_ERROR_RE.search(text)
    if m:
        return int(m[1])
    lowered = text.lower()
    return next((c for t, c in _OS_ERROR_TEXT.items() if t in lowered), None)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 10e9 else f"{n / 1e9:.1f} GB"


def disk_full_detail(folder: str | Path, needed: int | None = None, written: int | None = None) -> str:
    """"; it needs 12.0 MB and 3.1 MB are free in 'folder'": the numbers a full-disk message gives (without
    ``needed``: more than is free, and what was written before the disk filled)."""
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = _mb(shutil.disk_usage(probe).free)
    except OSError:
        free = None
    if needed:
        return f"; it needs {_mb(needed)} and " + (f"{free} are free in '{folder}'" if free else
                                                    f"'{folder}' has less free")
    more = f"; it needs more than the {free} free in '{folder}'" if free else f"; '{folder}' has no room for it"
    return more + (f" ({_mb(written)} were written before the disk filled)" if written else "")


def explain_os_error(exc: BaseException, what: str, where: str | Path, needed: int | None = None,
                     written: int | None = None) -> StorageError:
    """A StorageError naming ``what`` was being written, ``where``, why, and the fix. For a full disk also the
    folder's free bytes and what was ``needed`` (or at least ``written`` before the disk filled)."""
    where = str(where)
    code = os_errno_of(exc)
    if isinstance(exc, ValueError) and "null" in str(exc).lower():
        why, fix = "the name contains a NUL byte", "remove the NUL character from the name/prefix"
    elif code in (errno.EROFS, errno.EACCES, errno.EPERM):
        why, fix = "the folder is not writable", ("pick a writable folder (e.g. --output-dir, or ComfyUI's "
                                                  "--output-directory), or fix the folder's permissions")
    elif code in (errno.ENOSPC, errno.EDQUOT):
        why = "the disk is full (or over quota)"
        fix = "free space on that disk or write to another one"
        if code is not None:
            why += f" ({os.strerror(code)})"
        why += disk_full_detail(Path(where).parent, needed, written)
    elif code == errno.ENAMETOOLONG:
        why, fix = "a file or folder name is too long", "use a shorter name/prefix (at most ~200 characters per part)"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        why, fix = ("a part of the path is a file where a folder is needed",
                    "move or rename that file, or pick another path")
    elif code == errno.EISDIR:
        why, fix = "a folder is in the way of the file", "move or rename that folder, or pick another name"
    else:
        why, fix = f"{type(exc).__name__}: {exc}", "check the path and the disk"
    if code is not None and why != f"{type(exc).__name__}: {exc}" and code not in (errno.ENOSPC, errno.EDQUOT):
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


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _explained(exc: BaseException, what: str, path: Path, size: int | None, tmp: Path) -> StorageError:
    """The StorageError for a failed write, the temp file removed first (so a full disk's free space is what
    the disk has without it)."""
    written = _size(tmp)
    with contextlib.suppress(OSError):
        tmp.unlink()
    return explain_os_error(exc, what, path, size, written)


@contextlib.contextmanager
def atomic_write(path: str | Path, what: str = "a file", overwrite: bool = True,
                 size: int | None = None) -> Iterator[Path]:
    """Yield a temp path to write; on success it becomes ``path`` (fsynced, mode from the
    umask). On any error the temp file is removed and ``path`` is untouched. With
    ``overwrite=False`` an existing ``path`` raises FileExistsError. ``size``: the bytes the
    file will take, if known (a full disk's message then says how much was needed)."""
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
            raise _explained(exc, what, path, size, tmp) from exc
        except Exception as exc:  # a writer's own exception type around an OS error (SafetensorError)
            if os_errno_of(exc) is None:
                raise
            raise _explained(exc, what, path, size, tmp) from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    _fsync_dir(path.parent)


def write_bytes_atomic(path: str | Path, data: bytes, what: str = "a file", overwrite: bool = True) -> Path:
    with atomic_write(path, what, overwrite, size=len(data)) as tmp:
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


class FileLock:
    """An exclusive lock on ``path`` held by this process until ``release`` (or its death: the OS drops it,
    so a killed run never leaves a stale lock). ``acquire`` does not wait: it returns False while another
    process holds it; ``holder()`` then says who (the pid and start time it wrote into the file)."""

    def __init__(self, path: str | Path, what: str = "a lock file"):
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def acquire(self) -> bool:
        ensure_dir(self.path.parent, self.what)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise explain_os_error(exc, self.what, self.path) from None
        try:
            _lock_fd(fd)
        except OSError:
            os.close(fd)
            return False
        import time

        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return True

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_text())
            return f"process {info['pid']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            _unlock_fd(fd)
        os.close(fd)

    def __enter__(self) -> "FileLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _lock_fd(fd: int) -> None:
    """Take an exclusive, non-blocking OS lock on an open file; OSError when another process holds it."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _unlock_fd(fd: int) -> None:
    try:
        import fcntl
    except ImportError:
        import msvcrt

        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        return
    fcntl.flock(fd, fcntl.LOCK_UN)
