"""The output file: JSONL, one whole line per finished record, safe to resume after kill -9.

A record is appended as one write of one complete line, then flushed to disk (fsync), so a crash
leaves at most one torn line, at the end; reopening cuts it off (its record is asked for again).
Every record names its source (`file:line`), so a rerun skips the sources already written and never
writes one twice. A resumed run must use the settings the file was written with. One run at a time:
the file is flocked while open (released when the process ends, even by SIGKILL), so a second run
into it is refused instead of asking for every record again.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from dflash_cache.errors import DFlashCacheError
from dflash_cache.regenerate.settings import GenerationSettings, differences


class ResponsesFile:
    def __init__(self, path: str | Path, settings: GenerationSettings):
        self.path = Path(path)
        self.done: set[str] = set()  # sources already written
        self.model: str | None = None  # the model that wrote the existing records
        self.cut_bytes = 0  # size of a torn last line removed on opening
        self.created = not self.path.exists()  # then a run that wrote nothing removes it on closing
        if self.created:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open_locked()
        try:
            self._resume(settings)
        except BaseException:
            self.close()
            raise

    def _open_locked(self) -> int:
        while True:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DFlashCacheError(
                    f"{self.path} is being written by another regenerate run; wait for it or stop it first"
                ) from None
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)  # the file was removed (by a run that wrote nothing) while this one waited: open it again

    def _resume(self, settings: GenerationSettings) -> None:
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
        if whole < len(data):
            self.cut_bytes = len(data) - whole
            os.truncate(self.path, whole)
        for lineno, line in enumerate(data[:whole].splitlines(), start=1):
            where = f"{self.path}:{lineno}"
            try:
                record = json.loads(line)
                source, generation = record["source"], record["generation"]
                model = generation["model"]
            except (ValueError, KeyError, TypeError):
                raise DFlashCacheError(
                    f"{where} is not a record written by regenerate; give --out a new file"
                ) from None
            changed = differences(generation, settings)
            if changed:
                raise DFlashCacheError(
                    f"{self.path} was written with other settings ({'; '.join(changed)}); "
                    "rerun with the same settings or give --out a new file"
                )
            if self.model is None:
                self.model = model
            elif model != self.model:
                raise DFlashCacheError(f"{where} was written by model {model!r}, earlier lines by {self.model!r}")
            if source in self.done:
                raise DFlashCacheError(f"{where} repeats source {source}; the file was edited by hand?")
            self.done.add(source)

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(line)
        while view:  # a regular file takes it in one write; the loop only guards against short writes
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)
        self.done.add(record["source"])

    def close(self) -> None:
        if self._fd >= 0:
            if self.created and os.fstat(self._fd).st_size == 0:
                self.path.unlink(missing_ok=True)  # under the lock: nothing half-made is left behind
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResponsesFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
