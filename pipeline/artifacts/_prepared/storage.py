"""Where data/prepared/'s bytes come from: this disk (LocalFiles) or the DVC remote (DvcRemoteFiles), both behind
the small `Files` protocol the reader asks for bytes, sizes and rows through."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel

from pipeline.artifacts._files import read_model
from pipeline.artifacts._prepared.schema import PREPARED_DIR, RERUN
from pipeline.errors import StageError

M = TypeVar("M", bound=BaseModel)


class Files(Protocol):
    """What the reader needs of a copy of data/prepared/: its files by name (`SPLIT/images-NNNNN.npy`,
    `manifest.json`, ...), whole or a row at a time. A copy that is not on this disk is one more class of these
    methods, with no change to the reader."""

    def where(self, name: str) -> str:
        """The file as error messages name it."""
        ...

    def read_bytes(self, name: str) -> bytes:
        """The whole file (FileNotFoundError when missing)."""
        ...

    def read_record(self, name: str, schema: type[M]) -> M:
        """A JSON file validated against `schema`; a StageError naming the file when missing or foreign."""
        ...

    def size(self, name: str) -> int:
        """The file's length in bytes."""
        ...

    def read_into(self, name: str, offset: int, buffer: np.ndarray) -> int:
        """Fill the uint8 `buffer` from `offset`: the bytes read (fewer at the file's end)."""
        ...

    def read_rows(self, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
        """buffers[k] from offsets[k] (a batch's rows of one shard): the bytes each read got."""
        ...

    def close(self) -> None:
        """Let go of open files (the object can still be used: they open again)."""
        ...


class LocalFiles:
    """data/prepared/ on this machine's disk: rows read with `pread` into the caller's buffer."""

    def __init__(self, root: Path = PREPARED_DIR) -> None:
        self.root = Path(root)
        self._fds: dict[str, int] = {}

    def where(self, name: str) -> str:
        return str(self.root / name)

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_record(self, name: str, schema: type[M]) -> M:
        return read_model(self.root / name, schema, RERUN)

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def read_into(self, name: str, offset: int, buffer: np.ndarray) -> int:
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.root / name, os.O_RDONLY)
        return os.preadv(fd, [buffer.data], offset)

    def read_rows(self, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
        """buffers[k] from offsets[k] (the caller's uint8 rows): one pread each; the bytes each read got."""
        return _row_by_row(self, name, offsets, buffers)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, object]:  # file descriptors do not travel to another process
        return {**self.__dict__, "_fds": {}}


class DvcRemoteFiles:
    """data/prepared/ as a DVC repository's dvc.lock records it, read through DVC's own filesystem (dvc.api):
    from the local cache when it has the files, else straight from the DVC remote (S3, GCS, Azure, SSH, ...) by
    ranged reads, with no `dvc pull` and no shared disk: how processes on several machines read one data set."""

    def __init__(
        self, repo: str = ".", rev: str | None = None, path: str = str(PREPARED_DIR), *, ranged: bool = True
    ) -> None:
        """`ranged=False` reads row by row even where concurrent ranges work (`python -m benchmarks remote-read`)."""
        from dvc.api import DVCFileSystem

        self.repo, self.rev, self.path, self.ranged = repo, rev, path.rstrip("/"), ranged
        self.fs = DVCFileSystem(repo, rev=rev)
        self._files: dict[str, Any] = {}
        self._remote: Any = None  # the default remote's fsspec filesystem, once a batch needs it
        self._urls: dict[str, str] = {}

    def where(self, name: str) -> str:
        return f"{self.path}/{name} (DVC remote of {self.repo}{'@' + self.rev if self.rev else ''})"

    def read_bytes(self, name: str) -> bytes:
        data: bytes = self.fs.cat_file(f"{self.path}/{name}")
        return data

    def read_record(self, name: str, schema: type[M]) -> M:
        try:
            return schema.model_validate_json(self.read_bytes(name))
        except Exception as exc:  # any fsspec backend's error, or a foreign file
            raise StageError(f"{self.where(name)} cannot be read ({type(exc).__name__}: {exc})") from None

    def _open(self, name: str) -> Any:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = self.fs.open(f"{self.path}/{name}", "rb")
        return f

    def size(self, name: str) -> int:
        f = self._open(name)  # the remote's object size (a directory's listing may not record it)
        return int(f.size) if hasattr(f, "size") else int(f.seek(0, os.SEEK_END))  # a file of the workspace

    def read_into(self, name: str, offset: int, buffer: np.ndarray) -> int:
        f = self._open(name)
        f.seek(offset)
        data = f.read(buffer.nbytes)
        buffer[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def read_rows(self, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
        """A batch's rows of one shard as concurrent ranged GETs of exactly their bytes (fsspec's `cat_ranges`
        on the remote's own filesystem: s3fs, gcsfs, adlfs), not one block-cached seek and read after another:
        a batch waits for one round trip, not one per row. Falls back to `read_into` where the remote's
        filesystem cannot (a local or SSH remote, no remote configured) and where this machine's DVC cache holds
        the shard."""
        remote = self._remote_of(name)
        if remote is None:
            return _row_by_row(self, name, offsets, buffers)
        fs, url = remote
        ends = [offset + row.nbytes for offset, row in zip(offsets, buffers, strict=True)]
        parts = fs.cat_ranges([url] * len(offsets), list(offsets), ends, on_error="return")
        got = []
        for part, row in zip(parts, buffers, strict=True):
            if isinstance(part, BaseException):
                raise StageError(f"shard {self.where(name)} cannot be read from {url} ({type(part).__name__}: {part})")
            row[: len(part)] = np.frombuffer(part, dtype=np.uint8)
            got.append(len(part))
        return got

    def _remote_of(self, name: str) -> tuple[Any, str] | None:
        if not self.ranged:
            return None
        if name in self._urls:
            return (self._remote, self._urls[name]) if self._urls[name] else None
        url = ""
        try:
            import dvc.api
            from dvc.repo import Repo

            with Repo(self.repo) as repo:
                if self._remote is None:
                    self._remote = repo.cloud.get_remote().fs.fs  # the fsspec instance, with the remote's config
                if hasattr(self._remote, "cat_ranges") and getattr(self._remote, "async_impl", False):
                    url = dvc.api.get_url(f"{self.path}/{name}", repo=self.repo, rev=self.rev)
                    oid = "".join(url.rsplit("/", 2)[-2:])  # .../files/md5/ab/cdef...: the object's md5
                    if repo.cache.local.exists(oid):  # pulled into this machine's cache: read it there
                        url = ""
        except Exception:  # no default remote, or one fsspec cannot range-read concurrently: read row by row
            url = ""
        self._urls[name] = url
        return (self._remote, url) if url else None

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_files": {}, "_remote": None, "_urls": {}}


def _row_by_row(files: Files, name: str, offsets: Sequence[int], buffers: Sequence[np.ndarray]) -> list[int]:
    """buffers[k] from offsets[k], one `read_into` each: the bytes each read got."""
    return [files.read_into(name, offset, row) for offset, row in zip(offsets, buffers, strict=True)]


def files_of(prepared: Path | Files) -> Files:
    """`prepared` itself, or a path's LocalFiles."""
    return LocalFiles(Path(prepared)) if isinstance(prepared, str | os.PathLike) else prepared
