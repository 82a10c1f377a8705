"""The CPU backend's weight sync through one shared-memory file (docs/verl_integration.md#cpu-backend).

The actor worker and the rollout server run on one host. Instead of sending the full state dict through Ray's
object store every step (a serialisation, a copy into the store and one out of it), the worker writes the rollout's
weights, in the rollout's dtype, into a file both processes map, and the server copies them from there into its
parameters. Only the :class:`Layout` (names, shapes, offsets) crosses Ray. The file is reserved in full when it is
created (``posix_fallocate``), so a full file system is an error at creation, never a fault in the middle of a
write; it lives in ``/dev/shm`` where that has room, else in the temporary directory.

A file's name holds the writer's process id (``setgrpo-rollout-weights-<pid>-<id>``). A writer removes it as soon as
both processes map the file, or when its first sync fails; a writer killed in between cannot, so every new buffer
first removes the files of writers that no longer exist (:func:`remove_stale`): a killed first sync leaves the whole
model in shared memory only until the next sync on the host.

Ordering: the worker writes the next step's weights only after the server has returned from loading the previous
ones (verl awaits the weight sync before the next rollout), so a load never reads a half-written buffer.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

#: Where the buffer goes when it has room: memory, not disk.
SHM_DIR = Path("/dev/shm")
#: The start of a buffer file's name; the writer's process id follows.
PREFIX = "setgrpo-rollout-weights-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(directories: tuple[Path, ...] | None = None) -> list[Path]:
    """Remove the buffer files (``PREFIX<pid>-*``) of writers that no longer exist, in ``directories`` (by default
    ``/dev/shm`` and the temporary directory, where :meth:`WeightBuffer.create` puts them); returns the paths
    removed. A file whose writer lives (or whose name holds no process id) is left alone."""
    removed = []
    for directory in directories or (SHM_DIR, Path(tempfile.gettempdir())):
        if not Path(directory).is_dir():
            continue
        for path in Path(directory).glob(PREFIX + "*"):
            pid = path.name[len(PREFIX):].partition("-")[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                path.unlink()
            except (FileNotFoundError, PermissionError):
                continue
            removed.append(path)
    return removed


@dataclass(frozen=True)
class Layout:
    """Where each weight lies in the buffer: ``entries`` of ``(name, shape, offset)`` in elements of ``dtype``, in
    the order the actor yields its weights; ``numel`` elements in all."""

    entries: tuple[tuple[str, tuple[int, ...], int], ...]
    dtype: torch.dtype
    numel: int

    @classmethod
    def of(cls, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> "Layout":
        """The layout of ``(name, shape)`` pairs packed one after the other. Raises ``ValueError`` for a repeated
        name (two weights would share one slot)."""
        entries, offset, seen = [], 0, set()
        for name, shape in shapes:
            if name in seen:
                raise ValueError(f"weight {name!r} appears twice in the actor's weights: each name needs its own slot")
            seen.add(name)
            entries.append((name, tuple(int(s) for s in shape), offset))
            offset += prod(shape)
        return cls(entries=tuple(entries), dtype=dtype, numel=offset)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _directory(nbytes: int, keep_free: int = 0) -> Path:
    """``/dev/shm`` when it exists and has room for ``nbytes`` while leaving ``keep_free`` bytes (Ray's object
    store, which also lives there and takes its pages as it fills) and a margin of 1 GiB, else the temporary
    directory."""
    if SHM_DIR.is_dir():
        stat = os.statvfs(SHM_DIR)
        if stat.f_bavail * stat.f_frsize >= nbytes + keep_free + 2**30:
            return SHM_DIR
    return Path(tempfile.gettempdir())


class WeightBuffer:
    """One mapping of the shared file: ``views`` are tensors of the layout's shapes over it (no copies).

    Create it in the writer with :meth:`create` and open it in the reader with :meth:`open`; once both hold it, the
    writer may :meth:`unlink` the file (the mappings stay valid until both processes drop them).
    """

    def __init__(self, path: Path, layout: Layout):
        self.path = Path(path)
        self.layout = layout
        flat = torch.from_file(str(self.path), shared=True, size=layout.numel, dtype=layout.dtype)
        self.views = {name: flat[offset:offset + prod(shape)].view(shape) for name, shape, offset in layout.entries}

    @classmethod
    def create(cls, layout: Layout, directory: Path | None = None, keep_free: int = 0) -> "WeightBuffer":
        """A new file of ``layout.nbytes`` bytes, reserved in full, mapped; in ``directory``, by default
        ``/dev/shm`` where it has room beyond ``keep_free`` bytes, else the temporary directory. The files of dead
        writers (:func:`remove_stale`) are removed first, from both places and ``directory``.

        Raises:
            OSError: the file system has no room for it (``posix_fallocate``); the message names the directory and
                the size.
        """
        remove_stale((SHM_DIR, Path(tempfile.gettempdir()), *(() if directory is None else (Path(directory),))))
        directory = Path(directory) if directory is not None else _directory(layout.nbytes, keep_free)
        path = directory / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(1, layout.nbytes))
        except OSError as err:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise OSError(err.errno, f"the rollout weight buffer needs {layout.nbytes / 2**20:.0f} MiB in "
                                     f"{directory}: {err.strerror}; free space there or set TMPDIR to a directory "
                                     "with room") from err
        os.close(fd)
        try:
            return cls(path, layout)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def open(cls, path: str | Path, layout: Layout) -> "WeightBuffer":
        """Map an existing buffer. Raises ``ValueError`` when the file is not the layout's size."""
        size = Path(path).stat().st_size
        if size != layout.nbytes:
            raise ValueError(f"rollout weight buffer {path}: {size} bytes, its layout needs {layout.nbytes}")
        return cls(path, layout)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into its slot, converting to the buffer's dtype as ``Tensor.to`` does. Raises
        ``KeyError`` for a name the layout does not have and ``ValueError`` for another shape."""
        if name not in self.views:
            raise KeyError(f"weight {name!r} is not in the rollout weight buffer's layout (made at the first sync): "
                           "the actor and the rollout must keep one set of parameters for the whole run")
        view = self.views[name]
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)}, the buffer holds {tuple(view.shape)} from "
                             "the first sync: the actor and the rollout must keep one set of parameters for the run")
        view.copy_(tensor.detach())

    def write_all(self, weights) -> None:
        """Write every ``(name, tensor)`` of ``weights`` (an FSDP2 ``DTensor`` shard is gathered first with
        ``full_tensor()``, a collective every rank of the mesh must join in the same order), as :meth:`write`.

        Raises:
            KeyError, ValueError: as :meth:`write`, for the first weight refused, once every weight has been
                gathered (a rank that stopped early would leave the others waiting in a gather).
            RuntimeError: a weight of the layout is not among ``weights`` (the server would keep its old value).
        """
        written, problems = set(), []
        for name, tensor in weights:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            try:
                self.write(name, tensor)
                written.add(name)
            except (KeyError, ValueError) as err:
                problems.append(err)
        if problems:
            raise problems[0]
        if written != set(self.views):
            missing = sorted(set(self.views) - written)
            raise RuntimeError(f"transformers rollout weight sync: {len(missing)} of the first sync's weights are "
                               f"missing from this one (e.g. {missing[:3]}); the actor and the rollout must keep one "
                               "set of parameters for the whole run")

    def unlink(self) -> None:
        """Remove the file's name; the mappings stay valid."""
        self.path.unlink(missing_ok=True)
