"""A reader of dflash-cache directories written from FORMAT.md alone, with nothing of dflash_cache:
the json, hashlib and zlib modules, numpy, pyarrow and zstandard. It checks what FORMAT.md says a
reader checks and decodes every sample; tests/store/test_format_reader.py holds it to a real cache."""

import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import zstandard

FORMAT_VERSION = 2
FIELDS = [
    "sample_id",
    "num_tokens",
    "input_ids",
    "loss_mask",
    "target_ids",
    "topk_ids",
    "topk_logprobs",
    "hidden",
    "hidden_scales",
    "checksum",
    "record_id",
]


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T]
    target_ids: np.ndarray  # int32 [T]
    hidden: np.ndarray  # float32 [T, W], each value a bf16 value
    topk_ids: np.ndarray | None  # int32 [T, K]
    topk_logprobs: np.ndarray | None  # float32 [T, K]
    record_id: str | None


def manifest_checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(root: Path) -> dict:
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["format"] == "dflash-cache" and manifest["format_version"] <= FORMAT_VERSION
    assert manifest["checksum"] == manifest_checksum(manifest), "manifest checksum"
    assert [s["path"] for s in manifest["shards"]] == sorted(s["path"] for s in manifest["shards"])
    return manifest


def bf16_to_float32(words: np.ndarray) -> np.ndarray:
    """uint16 bf16 words -> float32 of the same values (a bf16 is the high half of a float32)."""
    return (words.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding the nearest bf16 (ties to even), as torch's conversion rounds."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def e4m3fn_values() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bytes: sign, 4 exponent bits (bias 7), 3
    mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN and there is no infinity."""
    byte = np.arange(256)
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(exponent == 0xF) & (mantissa == 0x7)] = np.nan
    return values.astype(np.float32)


def decode_hidden(codec: str, payload: bytes, scales: bytes | None, tokens: int, width: int, layers: int):
    n = tokens * width
    if codec == "bf16":
        words = np.frombuffer(payload, dtype="<u2")
    elif codec == "bf16-zstd":
        frame, lo = payload[: len(payload) - n], np.frombuffer(payload[len(payload) - n :], dtype=np.uint8)
        assert zstandard.frame_content_size(frame) == n, "high-byte plane's declared size"
        hi = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=np.uint8)
        words = (hi.astype(np.uint16) << 8) | lo
    elif codec == "fp8-zstd":
        q = np.frombuffer(zstandard.ZstdDecompressor().decompress(payload, max_output_size=n), dtype=np.uint8)
        s = np.frombuffer(scales, dtype="<f4").reshape(tokens, layers, 1)
        x = e4m3fn_values()[q].reshape(tokens, layers, width // layers) * s
        return float32_to_bf16(x.reshape(tokens, width))
    elif codec in ("fp4", "fp4-zstd"):
        per_token = width // 2 + width // 16
        raw = (
            payload
            if codec == "fp4"
            else zstandard.ZstdDecompressor().decompress(payload, max_output_size=tokens * per_token)
        )
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(tokens, per_token)
        packed, e = rows[:, : width // 2], rows[:, width // 2 :]
        codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(tokens, width)
        magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)[codes & 0x7]
        s = np.frombuffer(scales, dtype="<f4").reshape(tokens, layers, 1)
        step = (e4m3fn_values()[e].reshape(tokens, layers, -1) * s).reshape(tokens, -1)  # d = float32(e) * s
        value = np.where(codes & 0x8, -magnitude, magnitude) * np.repeat(step, 16, axis=1)
        return float32_to_bf16(value)
    else:
        raise AssertionError(f"unknown codec {codec}")
    assert words.size == n
    return bf16_to_float32(words).reshape(tokens, width)


def row_checksum(row: dict) -> int:
    crc = 0
    for part in [
        np.asarray(row["input_ids"], dtype="<i4").tobytes(),
        np.asarray(row["loss_mask"], dtype=np.uint8).tobytes(),
        np.asarray(row["target_ids"], dtype="<i4").tobytes(),
        None if row["topk_ids"] is None else np.asarray(row["topk_ids"], dtype="<i4").tobytes(),
        None if row["topk_logprobs"] is None else np.asarray(row["topk_logprobs"], dtype="<f4").tobytes(),
        row["hidden"],
        row["hidden_scales"],
        None if row.get("record_id") is None else row["record_id"].encode("utf-8"),
    ]:
        if part is not None:
            crc = zlib.crc32(part, crc)
    return crc


def read_samples(root: Path) -> dict[int, Sample]:
    """Every sample of the complete cache at `root`, each shard and row checked on the way."""
    manifest = read_manifest(root)
    spec = manifest["spec"]
    layers, k = len(spec["layer_ids"]), spec["topk"]
    width = layers * spec["target"]["hidden_size"]
    samples = {}
    for entry in manifest["shards"]:
        data = (root / entry["path"]).read_bytes()
        assert len(data) == entry["bytes"] and hashlib.sha256(data).hexdigest() == entry["sha256"], entry["path"]
        reader = pa.ipc.open_file(pa.BufferReader(data))
        assert reader.schema.names == FIELDS[: len(reader.schema.names)] and len(reader.schema.names) >= 10
        assert reader.num_record_batches == entry["rows"]
        for i in range(entry["rows"]):
            batch = reader.get_batch(i)
            assert batch.num_rows == 1
            row = {name: batch.column(name)[0].as_py() for name in batch.schema.names}
            tokens = row["num_tokens"]
            assert row["sample_id"] == entry["sample_ids"][i] and tokens == entry["num_tokens"][i]
            assert row.get("record_id") == (entry["record_ids"][i] if entry["record_ids"] else None)
            assert row["checksum"] == row_checksum(row), f"{entry['path']} row {i}"
            topk = row["topk_ids"] is not None
            assert topk == (k > 0)
            samples[row["sample_id"]] = Sample(
                sample_id=row["sample_id"],
                input_ids=np.asarray(row["input_ids"], dtype=np.int32),
                loss_mask=np.asarray(row["loss_mask"], dtype=bool),
                target_ids=np.asarray(row["target_ids"], dtype=np.int32),
                hidden=decode_hidden(spec["codec"], row["hidden"], row["hidden_scales"], tokens, width, layers),
                topk_ids=np.asarray(row["topk_ids"], dtype=np.int32).reshape(tokens, k) if topk else None,
                topk_logprobs=np.asarray(row["topk_logprobs"], dtype=np.float32).reshape(tokens, k) if topk else None,
                record_id=row.get("record_id"),
            )
    assert len(samples) == manifest["totals"]["samples"]
    assert sum(len(s.input_ids) for s in samples.values()) == manifest["totals"]["tokens"]
    return samples


def read_safetensors_bf16(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file of bf16 tensors: an 8-byte little-endian header length, the JSON header
    (name -> dtype, shape, data_offsets from the end of the header), then the data."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "BF16", (name, info["dtype"])
        start, end = info["data_offsets"]
        words = np.frombuffer(data[8 + size + start : 8 + size + end], dtype="<u2")
        tensors[name] = bf16_to_float32(words).reshape(info["shape"])
    return tensors


def config_hash(config_json: Path) -> str:
    config = json.loads(config_json.read_text(encoding="utf-8"))
    config.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_hash(folder: Path) -> str:
    """`spec.target.weights.sha256` with `content_hashed` true."""
    names = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    lines = "".join(f"{name}\0{hashlib.sha256((folder / name).read_bytes()).hexdigest()}\n" for name in names)
    return hashlib.sha256(lines.encode()).hexdigest()


def journal_shards(root: Path) -> list[dict]:
    """The shard entries of every journal, sorted by path (a torn last line ignored)."""
    shards = []
    for journal in sorted((root / "journal").glob("r*.jsonl")):
        lines = journal.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                assert i == len(lines) - 1, f"{journal}: line {i + 1} is torn"
                continue
            if "shard" in record:
                shards.append(record["shard"])
    return sorted(shards, key=lambda s: s["path"])
