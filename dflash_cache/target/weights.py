"""The target's weights as one digest for the cache spec: a cache must come from one set of weights,
whatever the folder is called and whatever config.json says.

By default every byte of every weight file is hashed (sha256), once: the digest of each file is
kept in the user's cache folder under its path, size, inode and modification and change times, so
a rerun on unchanged files reads none of them again. `content=False` (`--skip-weights-hash`) hashes
instead each file's size, safetensors header and 16 blocks of 64 KiB spread over it: it tells
checkpoints of one architecture apart in practice, at no cost, and the spec records which was used.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dflash_cache.store.shard import file_sha256

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLED_BLOCKS, BLOCK_BYTES = 16, 64 << 10
MAX_HEADER_BYTES = 100 << 20  # a safetensors header is JSON; anything longer is not one


def weight_files(target: Path) -> list[Path]:
    return sorted(p for p in Path(target).iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def weights_digest(target: Path, content: bool = True) -> dict:
    """{"content_hashed": content, "sha256": hex digest over every weight file's name and digest}."""
    sha = hashlib.sha256()
    for path in weight_files(target):
        digest = _content_sha256(path) if content else _sampled_sha256(path)
        sha.update(f"{path.name}\0{digest}\n".encode())
    return {"content_hashed": content, "sha256": sha.hexdigest()}


def _memo_path(path: Path) -> Path:
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_ino}\0{st.st_dev}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "dflash-cache" / "weight-hashes" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _content_sha256(path: Path) -> str:
    memo = _memo_path(path)
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = file_sha256(path)
    try:  # a read-only home only costs the hash again next time
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def _sampled_sha256(path: Path) -> str:
    size = path.stat().st_size
    sha = hashlib.sha256(str(size).encode() + b"\0")
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            header = int.from_bytes(f.read(8), "little")
            sha.update(f.read(min(header, MAX_HEADER_BYTES)))
        for i in range(SAMPLED_BLOCKS):
            f.seek(max(0, size - BLOCK_BYTES) * i // max(SAMPLED_BLOCKS - 1, 1))
            sha.update(f.read(BLOCK_BYTES))
    return sha.hexdigest()
