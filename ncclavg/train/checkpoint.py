"""Checkpoint files: atomic writes, a checksum verified on load, and a directory that keeps the newest
complete checkpoints.

File layout (little endian):
    magic  b"NCAVGCKP"            8 bytes
    format version (u32)          4 bytes
    payload length (u64)          8 bytes
    sha256(payload)              32 bytes
    payload                      torch.save() of a dict of tensors and plain Python values

Note [Atomic checkpoint write]
A checkpoint is first written to a temporary file in the SAME directory (rename is only atomic within
one file system), flushed and fsync'ed, then renamed over the final name, then the directory is fsync'ed
so the rename itself survives a power loss. A reader therefore sees either the previous file or the
complete new one, never a partial file under the final name. Older checkpoints are deleted only after
the new one is complete, so the newest complete checkpoint always exists. The checksum catches what the
protocol cannot: media corruption, copies cut short, files edited by hand.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import socket
import struct
import uuid
import warnings
from typing import Any

import torch

MAGIC = b"NCAVGCKP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")
SUFFIX = ".ckpt"
_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


class CheckpointError(ValueError):
    """A checkpoint file failed a check; `path` is the file, `check` names the check that failed
    (exists, header, magic, version, length, checksum, decode, content)."""

    def __init__(self, path: str, check: str, detail: str):
        self.path, self.check = str(path), check
        super().__init__(f"checkpoint {self.path}: {check} check failed: {detail}")


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def encode(state: Any) -> bytes:
    """Header + payload bytes of a checkpoint (what `save` writes)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def save(path: str | os.PathLike, state: Any) -> str:
    """Write `state` to `path` atomically (see Note [Atomic checkpoint write]); returns the path.
    The parent directory must exist."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"path: directory {directory} does not exist")
    data = encode(state)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    return path


def verify_bytes(data: bytes, path: str = "<bytes>") -> bytes:
    """Check header, length and checksum; returns the payload or raises CheckpointError."""
    if len(data) < _HEADER.size:
        raise CheckpointError(path, "header", f"file is truncated: {len(data)} bytes, shorter than the "
                              f"{_HEADER.size}-byte header")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError(path, "magic", f"not an ncclavg checkpoint (starts with {magic!r}, "
                              f"expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CheckpointError(path, "version", f"format version {version} is not supported (this "
                              f"ncclavg reads version {FORMAT_VERSION})")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        what = "truncated" if len(payload) < length else "longer than its header says"
        raise CheckpointError(path, "length", f"file is {what}: the header promises {length} payload "
                              f"bytes, the file holds {len(payload)}")
    actual = hashlib.sha256(payload).digest()
    if actual != digest:
        raise CheckpointError(path, "checksum", f"sha256 of the payload is {actual.hex()[:16]}..., the "
                              f"header says {digest.hex()[:16]}...: the file is corrupted")
    return payload


def load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Read and verify a checkpoint written by `save`; raises CheckpointError naming the file and the
    failed check. Tensors are loaded with torch's weights_only unpickler (no arbitrary code)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(path, "exists", "no such file")
    with open(path, "rb") as f:
        data = f.read()
    payload = verify_bytes(data, path)
    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as e:  # the checksum matched, so this is a writer/reader version problem
        raise CheckpointError(path, "decode", f"payload could not be decoded: {e}") from e


_NAME = re.compile(r"^(?P<prefix>.+)-(?P<step>\d+)" + re.escape(SUFFIX) + "$")
# one process's part of a checkpoint written as a set (sharded master weights): <checkpoint>.part<r>-of-<P>
_PART = re.compile(r"^(?P<main>.+" + re.escape(SUFFIX) + r")\.part(?P<rank>\d+)-of-(?P<count>\d+)$")


def part_path(path: str, rank: int, count: int) -> str:
    """The file holding process `rank`'s part of the checkpoint `path` (written as a set of `count`)."""
    return f"{os.fspath(path)}.part{int(rank)}-of-{int(count)}"
# the temporary name `save` writes first: .<final name>.tmp-<host>-<pid>-<8 hex>. The host keeps
# remove_stale_temps from judging another machine's pids when the directory is on a shared file system.
_TEMP = re.compile(r"^\.(?P<final>.+)\.tmp-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class CheckpointManager:
    """A directory of `<prefix>-<step>.ckpt` files. `save` writes atomically and then keeps the newest
    `keep` complete checkpoints; `latest()` returns the newest one that passes verification (a corrupted
    newest file falls back to the previous one, with a warning)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2, prefix: str = "ckpt"):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep: must be an integer >= 1, got {keep!r}")
        if not prefix or os.sep in prefix:
            raise ValueError(f"prefix: must be a non-empty file name part, got {prefix!r}")
        self.directory = os.fspath(directory)
        self.keep = keep
        self.prefix = prefix

    def path_for(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{int(step):09d}{SUFFIX}")

    def list(self) -> list[tuple[int, str]]:
        """(step, path) of the checkpoint files present, oldest first (not verified)."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m and m.group("prefix") == self.prefix:
                found.append((int(m.group("step")), os.path.join(self.directory, name)))
        return sorted(found)

    def save(self, state: Any, step: int) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = save(self.path_for(step), state)
        for _, old in self.list()[:-self.keep]:
            self.remove(old)
        self.remove_stale_temps()
        return path

    def remove(self, path: str) -> None:
        """Deletes the checkpoint `path` and the parts of its set, if any (the checkpoint first: a set
        without its checkpoint file is never taken)."""
        for name in [os.path.basename(path)] + sorted(
                n for n in os.listdir(self.directory)
                if (m := _PART.match(n)) and m.group("main") == os.path.basename(path)):
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass

    def remove_stale_temps(self) -> list[str]:
        """Deletes the temporary files of saves whose process died mid-write (killed, power loss): they
        are never renamed, so without this every crash during a save would leave one behind. Temp files
        of a live process (a save in progress) are kept. Returns the paths removed."""
        removed = []
        if not os.path.isdir(self.directory):
            return removed
        for name in os.listdir(self.directory):
            m = _TEMP.match(name)
            part = _PART.match(m.group("final")) if m else None
            final = _NAME.match(part.group("main") if part else m.group("final")) if m else None
            if final is None or final.group("prefix") != self.prefix:
                continue
            if m.group("host") != _HOST or _pid_alive(int(m.group("pid"))):
                continue
            try:
                os.unlink(os.path.join(self.directory, name))
                removed.append(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        return removed

    def latest(self) -> str | None:
        """Path of the newest checkpoint that verifies, or None when there is none."""
        for _, path in reversed(self.list()):
            try:
                with open(path, "rb") as f:
                    verify_bytes(f.read(), path)
                return path
            except (CheckpointError, OSError) as e:
                warnings.warn(f"skipping unusable checkpoint: {e}", RuntimeWarning, stacklevel=2)
        return None


def resolve(path: str | os.PathLike, prefix: str = "ckpt") -> str:
    """A checkpoint file as given, or the newest verified checkpoint in a directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        found = CheckpointManager(path, prefix=prefix).latest()
        if found is None:
            raise CheckpointError(path, "exists", f"directory holds no complete {prefix}-*{SUFFIX} file")
        return found
    if not os.path.exists(path):
        raise CheckpointError(path, "exists", "no such file or directory")
    return path
