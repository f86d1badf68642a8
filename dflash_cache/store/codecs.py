"""Codecs for a bf16 hidden-state tensor [T, L*H].

Encoding happens in two steps so that the arithmetic can run where the tensor lives (the GPU during
extraction) and only the byte compression runs on host threads:

    encode(hidden)  -> EncodedHidden (uint8 planes + optional fp8 scales), any device
    compress(planes) -> payload      zstd on the host; releases the GIL
    decompress(payload) -> planes   host (decompress_into: into a given buffer); releases the GIL
    decode(planes, scales) -> hidden bf16 [T, L*H], any device

`bf16`      raw little-endian bf16 values.
`bf16-zstd` all high bytes, then all low bytes; the high-byte plane goes through zstd, the low-byte
            plane is stored as it is. Lossless. The high byte (sign, exponent, top mantissa bit) of
            real activations is very repetitive; the low byte is noise: zstd gains nothing on it
            and compressing only the high plane is over twice as fast for the same size.
`fp8-zstd`  float8 e4m3 with one fp32 scale per token per layer (amax / 448), zstd. Lossy.
`fp4`       e2m1 codes with one e4m3 scale per 16 values and one fp32 scale per token per layer (fp4.py).
`fp4-zstd`  the same, zstd on top. Lossy.
`subspace-C` each token's coordinates on a basis fitted to the target's states, coded by C (subspace.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from dflash_cache.choices import CODECS
from dflash_cache.errors import DFlashCacheError
from dflash_cache.store import fp4, subspace

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ZSTD_LEVEL = 1  # measured: level 1 is faster than 3 and no larger on byte-split activations


def check_codec(name: str) -> str:
    if name not in CODECS:
        raise DFlashCacheError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}")
    return name


@dataclass
class EncodedHidden:
    planes: torch.Tensor  # uint8 [n_bytes], on the device it was encoded on
    scales: torch.Tensor | None  # fp32 [T, L] for the fp8 and fp4 codecs, else None


def encode(hidden: torch.Tensor, codec: str, num_layers: int, basis: torch.Tensor | None = None) -> EncodedHidden:
    """Turn a bf16 [T, L*H] tensor into the bytes that get compressed (on hidden's device).
    `basis`: float32 [L*H, k] on that device, for the subspace codecs."""
    import torch  # here, not at the top: reading a manifest (`inspect`) needs no torch

    if subspace.is_subspace(codec):
        if basis is None:
            raise ValueError(f"{codec} needs the cache's basis")
        coords = subspace.project(hidden, basis)
        return encode(coords, subspace.inner_codec(codec), subspace.inner_groups(coords.shape[1]))
    if hidden.dtype != torch.bfloat16 or hidden.dim() != 2:
        raise ValueError(f"expected a 2-d bf16 tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if codec == "bf16":
        return EncodedHidden(hidden.contiguous().view(torch.uint8).reshape(-1), None)
    if codec == "bf16-zstd":
        pairs = hidden.contiguous().view(torch.uint8).reshape(-1, 2)  # [n, (low, high)]
        return EncodedHidden(torch.cat([pairs[:, 1], pairs[:, 0]]), None)
    if codec == "fp8-zstd":
        t = hidden.shape[0]
        x = hidden.reshape(t, num_layers, -1).float()
        scales = x.abs().amax(dim=-1).clamp_min(1e-30) / FP8_MAX  # [T, L]
        q = (x / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
        return EncodedHidden(q.view(torch.uint8).reshape(-1), scales)
    if codec in FP4_CODECS:
        planes, scales = fp4.encode(hidden, num_layers)
        return EncodedHidden(planes.reshape(-1), scales)
    raise DFlashCacheError(f"unknown codec {codec!r}")


def decode(planes: torch.Tensor, scales: torch.Tensor | None, codec: str, num_tokens: int, width: int) -> torch.Tensor:
    """Inverse of `encode`: bf16 [num_tokens, width] on planes' device (for the subspace codecs, the
    coordinates: width is k)."""
    import torch

    codec = subspace.inner_codec(codec)
    n = num_tokens * width
    if codec == "bf16":
        return planes.view(torch.bfloat16).reshape(num_tokens, width)
    if codec == "bf16-zstd":
        pairs = torch.stack([planes[n:], planes[:n]], dim=1)  # [n, (low, high)]
        return pairs.view(torch.bfloat16).reshape(num_tokens, width)
    if codec == "fp8-zstd":
        num_layers = scales.shape[1]
        q = planes.view(torch.float8_e4m3fn).reshape(num_tokens, num_layers, -1).float()
        return (q * scales.unsqueeze(-1)).to(torch.bfloat16).reshape(num_tokens, width)
    if codec in FP4_CODECS:
        return fp4.decode(planes, scales, num_tokens, width)
    raise DFlashCacheError(f"unknown codec {codec!r}")


FP4_CODECS = ("fp4", "fp4-zstd")
SCALED_CODECS = ("fp8-zstd", *FP4_CODECS)  # those with fp32 [T, L] `hidden_scales`
SUBSPACE_CODECS = tuple(c for c in CODECS if subspace.is_subspace(c))


def has_scales(codec: str) -> bool:
    return subspace.inner_codec(codec) in SCALED_CODECS


def stored_width(spec: dict) -> int:
    """Values a token's stored tensor holds: the layers' states, or a subspace codec's coordinates."""
    if subspace.is_subspace(spec["codec"]):
        return spec["subspace"]["rank"]
    return len(spec["layer_ids"]) * spec["target"]["hidden_size"]


def scale_columns(spec: dict) -> int:
    """fp32 scales a token's `hidden_scales` holds (0 for a codec without)."""
    if not has_scales(spec["codec"]):
        return 0
    if subspace.is_subspace(spec["codec"]):
        return subspace.inner_groups(spec["subspace"]["rank"])
    return len(spec["layer_ids"])


def plane_layout(codec: str, width: int) -> tuple[int, int]:
    """(planes, bytes of each plane per token) of a codec's encoded layout for rows of `width` values."""
    codec = subspace.inner_codec(codec)
    if codec in FP4_CODECS:
        return 1, fp4.token_bytes(width)
    return {"bf16": (1, 2 * width), "bf16-zstd": (2, width), "fp8-zstd": (1, width)}[codec]


def encoded_size(codec: str, num_tokens: int, width: int) -> int:
    """Bytes of the planes for a [num_tokens, width] tensor."""
    num_planes, token_bytes = plane_layout(codec, width)
    return num_tokens * num_planes * token_bytes


def stored_bytes_per_token(spec: dict) -> int:
    """Bytes a token costs in a cache of `spec` before zstd: its planes and its scales (zstd only
    shrinks this; raw bf16 planes are stored as they are)."""
    return encoded_size(spec["codec"], 1, stored_width(spec)) + 4 * scale_columns(spec)


def _zstd(data) -> bytes:
    # A compressor object is not thread-safe; a new one per call is cheap next to the work.
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def compress(planes: np.ndarray, codec: str) -> np.ndarray:
    """Encoded planes (uint8, C-contiguous) -> the stored payload, uint8.

    Bulk copies go through numpy, which releases the GIL while copying; `bytes` concatenation would
    hold it and stall the thread that drives the GPU.
    """
    codec = subspace.inner_codec(codec)
    if codec in ("bf16", "fp4"):
        return planes.copy()
    if codec == "bf16-zstd":
        half = planes.shape[0] // 2
        frame = _zstd(planes[:half])
        out = np.empty(len(frame) + planes.shape[0] - half, dtype=np.uint8)
        out[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        out[len(frame) :] = planes[half:]
        return out
    return np.frombuffer(_zstd(planes), dtype=np.uint8)


# The most bytes of planes a stored byte decodes to in a cache written as extract writes it: bf16 is
# stored as it is, bf16-zstd keeps its low-byte plane (half the planes) as it is, and zstd shrinks the
# e4m3 bytes of activations about 1.2x (1.07 to 1.23 measured: Gaussian, outlier and massive channels,
# the tiny test target's layers). Constant data reaches 30,000x: only a crafted cache holds it, and
# a spec whose width would need more than this lets a small file make readers allocate GBs a row.
# fp4 has no zstd and stores its planes as they are; zstd gains little on e2m1 codes.
MAX_EXPANSION = {"bf16": 1, "bf16-zstd": 2, "fp8-zstd": 16, "fp4": 1, "fp4-zstd": 16}
MAX_EXPANSION |= {c: MAX_EXPANSION[subspace.inner_codec(c)] for c in CODECS if subspace.is_subspace(c)}


def _unzstd_into(data: memoryview, out: np.ndarray, codec: str) -> None:
    view = memoryview(out).cast("B")
    filled = 0
    try:
        # All input at once: one GIL-free call decodes the frame, where the default read size retakes
        # the GIL every 128 KB of input (each retake can hold up the thread that drives the GPU).
        with zstandard.ZstdDecompressor().stream_reader(data, read_size=max(len(data), 1)) as reader:
            while filled < len(view):
                got = reader.readinto(view[filled:])
                if got == 0:
                    break
                filled += got
            extra = len(reader.read(1))
    except zstandard.ZstdError as e:
        raise DFlashCacheError(f"corrupt {codec} payload: {e}") from None
    if filled != len(view) or extra:
        raise DFlashCacheError(
            f"corrupt {codec} payload: decodes to {'more' if extra else filled} bytes, expected {len(view)}"
        )


def _copy_into(data: memoryview, out: np.ndarray, codec: str) -> None:
    if len(data) != out.size:
        raise DFlashCacheError(f"corrupt {codec} payload: {len(data)} raw bytes, expected {out.size}")
    np.copyto(out, np.frombuffer(data, dtype=np.uint8))


def decompress_into(payload, codec: str, out: np.ndarray) -> None:
    """Decompress a payload straight into `out`, uint8 [planes, bytes per plane] (PLANE_LAYOUT), each
    plane contiguous. The GIL stays released throughout (zstd writes into `out`, numpy copies the raw
    plane), so reader threads scale; joining planes into new bytes would hold it."""
    codec = subspace.inner_codec(codec)
    payload = memoryview(payload).cast("B")
    if codec in ("bf16", "fp4"):
        _copy_into(payload, out[0], codec)
    elif codec == "bf16-zstd":
        size = out.shape[1]
        if len(payload) < size:
            raise DFlashCacheError(f"corrupt {codec} payload: {len(payload)} bytes is too short")
        _unzstd_into(payload[: len(payload) - size], out[0], codec)
        _copy_into(payload[len(payload) - size :], out[1], codec)
    elif codec in ("fp8-zstd", "fp4-zstd"):
        _unzstd_into(payload, out[0], codec)
    else:
        raise DFlashCacheError(f"unknown codec {codec!r}")


def check_payload_size(payload, codec: str, size: int) -> None:
    """Refuse a payload that cannot decode to `size` bytes before `size` bytes are allocated: a
    manifest someone shared may declare a width of 2^36, each row then asking for terabytes. A zstd
    frame that declares its content size (ours always do) must declare the plane's."""
    codec = subspace.inner_codec(codec)
    payload = memoryview(payload).cast("B")
    stored_raw = codec in ("bf16", "fp4")
    raw = {"bf16-zstd": size // 2, "fp8-zstd": 0, "fp4-zstd": 0}.get(codec, size)  # bytes stored as they are
    if len(payload) < raw or (stored_raw and len(payload) != raw):
        raise DFlashCacheError(f"corrupt {codec} payload: {len(payload)} bytes cannot hold {size} bytes of planes")
    if stored_raw:
        return
    try:
        declared = zstandard.frame_content_size(payload[: len(payload) - raw])
    except zstandard.ZstdError as e:
        raise DFlashCacheError(f"corrupt {codec} payload: {e}") from None
    if declared not in (-1, size - raw):
        raise DFlashCacheError(
            f"corrupt {codec} payload: its zstd frame declares {declared} bytes, expected {size - raw}"
        )


def decompress(data, codec: str, size: int) -> np.ndarray:
    """Payload -> uint8 planes of exactly `size` bytes."""
    check_payload_size(data, codec, size)
    num_planes = 2 if subspace.inner_codec(codec) == "bf16-zstd" else 1
    out = np.empty((num_planes, size // num_planes), dtype=np.uint8)
    decompress_into(data, codec, out)
    return out.reshape(-1)
