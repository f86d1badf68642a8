"""Caches at fsspec URLs (`s3://`, `gs://`, ...): the few file operations the store needs, by path
relative to the cache root.

Credentials come from each filesystem's usual environment variables and config files (for S3:
AWS_ACCESS_KEY_ID / AWS_PROFILE / ~/.aws, AWS_ENDPOINT_URL for another S3-compatible server); this
module never sees them and nothing here writes them anywhere. A `file://` URL is a plain local path.
"""

from __future__ import annotations

import io
import os
import re
from contextlib import contextmanager
from pathlib import Path

from dflash_cache.errors import DFlashCacheError, first_line
from dflash_cache.files import faults

MIN_FETCH = 64 << 10  # smallest ranged read: an IPC footer, or a batch's metadata with a small body


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#]*@)")


def redact(url: str) -> str:
    """The URL with any `user:password@` part replaced by `***@`, for messages."""
    return _USERINFO.sub(r"\1***@", str(url))


def is_remote(path: str | os.PathLike) -> bool:
    text = str(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: str | os.PathLike) -> Path:
    text = str(path)
    return Path(text.removeprefix("file://"))


@contextmanager
def _errors(what: str):
    """Any failure of the remote filesystem becomes one line naming the URL (and not the credentials)."""
    try:
        yield
    except (DFlashCacheError, FileNotFoundError):
        raise
    except ImportError as e:  # fsspec names the package a protocol needs, e.g. s3fs
        raise DFlashCacheError(f"{what}: {first_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - network, permission and server errors of any backend
        raise DFlashCacheError(f"{what}: {type(e).__name__}: {first_line(e)}") from None


class RemoteDir:
    """A folder at an fsspec URL. The filesystem object is made on first use in each process, so a
    RemoteDir pickles into spawned workers as just its URL."""

    def __init__(self, url: str):
        if _USERINFO.match(str(url)):  # it would show in messages, logs, run files and process lists
            raise DFlashCacheError(
                f"{redact(url)}: credentials in the URL are not accepted; give them the "
                "filesystem's usual way (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE or ~/.aws)"
            )
        self.url = str(url).rstrip("/")
        self._fs = None
        self._root = ""

    def __getstate__(self) -> dict:
        return {"url": self.url, "_fs": None, "_root": ""}

    def __str__(self) -> str:
        return self.url

    @property
    def fs(self):
        return self._connect()[0]

    def _connect(self) -> tuple:
        if self._fs is None:
            import fsspec

            with _errors(self.url):
                # No listing cache: other processes (other ranks, other nodes) write here too.
                self._fs, self._root = fsspec.core.url_to_fs(self.url, use_listings_cache=False)
        return self._fs, self._root

    def path(self, rel: str) -> str:
        """The filesystem's own path of `rel` (the URL without its protocol)."""
        root = self._connect()[1]
        return f"{root}/{rel}" if rel else root

    def url_of(self, rel: str) -> str:
        return f"{self.url}/{rel}"

    def exists(self, rel: str) -> bool:
        with _errors(self.url_of(rel)):
            return self.fs.exists(self.path(rel))

    def size(self, rel: str) -> int:
        with _errors(self.url_of(rel)):
            return int(self.fs.size(self.path(rel)))

    def list(self, rel: str) -> list[str]:
        """Names of the files directly under `rel` (none when it does not exist)."""
        with _errors(self.url_of(rel)):
            if not self.fs.exists(self.path(rel)):
                return []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(rel), detail=False))

    def sizes(self, rel: str) -> dict[str, int]:
        """{name: bytes} of the files directly under `rel`, from one listing (none when it does not exist)."""
        with _errors(self.url_of(rel)):
            if not self.fs.exists(self.path(rel)):
                return {}
            return {
                e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
                for e in self.fs.ls(self.path(rel), detail=True)
                if e.get("type") == "file"
            }

    def read_bytes(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        with _errors(self.url_of(rel)):
            return self.fs.cat_file(self.path(rel), start=start, end=end)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """One object, whole or absent: object stores publish an upload only when it completes."""
        faults.point("remote.upload")
        with _errors(self.url_of(rel)):
            self.fs.pipe_file(self.path(rel), data)

    def upload(self, local: Path, rel: str) -> None:
        faults.point("remote.upload")
        with _errors(self.url_of(rel)):
            self.fs.put_file(str(local), self.path(rel))

    def download(self, rel: str, local: Path) -> None:
        """To `local` through a temporary name, so `local` is whole or absent."""
        tmp = local.with_name(local.name + f".{os.getpid()}.part")
        try:
            with _errors(self.url_of(rel)):
                self.fs.get_file(self.path(rel), str(tmp))
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)

    def delete(self, rel: str) -> None:
        with _errors(self.url_of(rel)):
            self.fs.rm_file(self.path(rel))


class RangeFile(io.RawIOBase):
    """A remote file of known size, read by byte ranges, for pyarrow to read an Arrow IPC file's
    footer and single record batches without fetching the rest.

    A read fetches at least MIN_FETCH bytes, shifted back from the end of the file when it would pass
    it: the first read (the last 10 bytes) then brings the footer along in the same request. Only such
    small windows are kept for the next read; a record batch is fetched exactly and not kept, so an
    open reader holds at most MIN_FETCH bytes.
    """

    def __init__(self, remote: RemoteDir, rel: str, size: int):
        super().__init__()
        self.remote, self.rel, self.size = remote, rel, size
        self.pos = 0
        self._start, self._data = 0, b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.pos + n, self.size)
        if end <= self.pos:
            return b""
        if self._start <= self.pos and end <= self._start + len(self._data):
            data = self._data[self.pos - self._start : end - self._start]
        elif end - self.pos >= MIN_FETCH:
            data = self._fetch(self.pos, end)
        else:
            start = max(0, min(self.pos, self.size - MIN_FETCH))
            self._start, self._data = start, self._fetch(start, min(start + MIN_FETCH, self.size))
            data = self._data[self.pos - start : end - start]
        self.pos = end
        return data

    def _fetch(self, start: int, stop: int) -> bytes:
        data = self.remote.read_bytes(self.rel, start, stop)
        if len(data) != stop - start:
            raise DFlashCacheError(
                f"{self.remote.url_of(self.rel)}: short read ({len(data)} of {stop - start} "
                "bytes); the object is shorter than the manifest says"
            )
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
