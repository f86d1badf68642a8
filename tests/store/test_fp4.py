"""The fp4 codec against a reference written from FORMAT.md value by value in plain Python."""

import numpy as np
import pytest
import torch

from dflash_cache.store.codecs import compress, decode, decompress, encode, encoded_size

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1 codes 0..7, as the OCP MX spec lists them


def e4m3_value(byte: int) -> float:
    """float8 e4m3fn from its bits: bias 7, no infinities, 0x7f/0xff NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E4M3 = sorted({e4m3_value(b) for b in range(0x7F)})  # the non-negative finite values


def nearest(value: float, grid: list[float]) -> int:
    """Index of the grid value nearest to value; a tie goes to the even index."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - value), i % 2))
    return best


def reference_encode(x: list[list[float]], layers: int, block: int = 16):
    """FORMAT.md's fp4 steps, one value at a time in float32: (token bytes, per-layer scales)."""
    f32 = np.float32
    rows, scales = [], []
    for token in x:
        token = [f32(v) for v in token]
        width = len(token) // layers
        s_layers = [
            max(max(abs(v) for v in token[j * width : (j + 1) * width]), f32(1e-30)) / f32(6 * 448)
            for j in range(layers)
        ]
        codes, block_bytes = [], []
        for b in range(len(token) // block):
            values = token[b * block : (b + 1) * block]
            s = s_layers[b * block // width]
            e = E4M3[nearest(min(float(max(abs(v) for v in values) / (f32(6) * s)), 448.0), E4M3)]
            block_bytes.append(next(byte for byte in range(0x7F) if e4m3_value(byte) == e))
            step = f32(e) * s
            for v in values:
                magnitude = 0 if step == 0 else nearest(min(float(abs(v) / step), 6.0), MAGNITUDES)
                codes.append(magnitude | (8 if v < 0 else 0))
        packed = [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]
        rows.append(bytes(packed + block_bytes))
        scales.append([float(v) for v in s_layers])
    return b"".join(rows), scales


def reference_decode(data: bytes, scales, width: int, block: int = 16) -> list[list[float]]:
    per_token = width // 2 + width // block
    out = []
    for t, s_layers in enumerate(scales):
        row = data[t * per_token : (t + 1) * per_token]
        codes = [c for byte in row[: width // 2] for c in (byte & 0xF, byte >> 4)]
        layer_width = width // len(s_layers)
        out.append(
            [
                (-1 if c & 8 else 1)
                * MAGNITUDES[c & 7]
                * e4m3_value(row[width // 2 + i // block])
                * s_layers[i // layer_width]
                for i, c in enumerate(codes)
            ]
        )
    return out


def test_every_code_and_every_midpoint_round_as_the_reference():
    """Block 0 holds the layer's amax 168, so s = 168 / (6 * 448) = 1/16; blocks 1 and 2 have amax
    12, so their e4m3 scale is 12 / (6 s) = 32 and their step 32 s = 2, all exact. Their values walk
    every code magnitude and every midpoint between two (ties to even), both signs."""
    big = 168.0
    grid = sorted(set(MAGNITUDES + [(a + b) / 2 for a, b in zip(MAGNITUDES, MAGNITUDES[1:])]))  # 15 values
    step = 2.0
    values = [big] + [0.0] * 15 + [g * step for g in grid] + [-g * step for g in grid] + [6 * step, 0.0]
    x = torch.tensor([values], dtype=torch.float32).bfloat16()
    enc = encode(x, "fp4", 1)
    data, scales = reference_encode(x.float().tolist(), 1)
    assert bytes(enc.planes.numpy()) == data
    assert enc.scales.tolist() == scales == [[1 / 16]]
    got = decode(enc.planes, enc.scales, "fp4", 1, x.shape[1]).float()
    assert got[0, 16:31].tolist() == [step * m for m in [0, 0, 0.5, 1, 1, 1, 1.5, 2, 2, 2, 3, 4, 4, 4, 6]]
    assert got[0, 31:46].tolist() == [-v for v in got[0, 16:31].tolist()]


@pytest.mark.parametrize("codec", ["fp4", "fp4-zstd"])
def test_random_activations_round_trip_as_the_reference(codec):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3 * 32, generator=g) * torch.rand(5, 1, generator=g) * 4
    x[:, 7] *= 300.0  # a massive dimension in layer 0
    x[1, 64:96] *= 1e-3  # a layer far quieter than the others
    x = x.bfloat16()
    enc = encode(x, codec, 3)
    data, scales = reference_encode(x.float().tolist(), 3)
    assert bytes(enc.planes.numpy()) == data
    torch.testing.assert_close(enc.scales, torch.tensor(scales), rtol=0, atol=0)
    size = encoded_size(codec, *x.shape)
    assert size == 5 * (48 + 6)
    planes = decompress(compress(enc.planes.numpy(), codec), codec, size)
    got = decode(torch.from_numpy(planes.copy()), enc.scales, codec, *x.shape)
    want = torch.tensor(reference_decode(data, scales, x.shape[1])).bfloat16()
    assert torch.equal(got, want)
    error = (got.float() - x.float()).norm(dim=1) / x.float().norm(dim=1)
    assert error.max() < 0.2  # e2m1 keeps about 3 bits: a coarse but faithful copy


def test_a_width_that_splits_a_block_across_layers_is_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        encode(torch.zeros(2, 2 * 24).bfloat16(), "fp4", 2)
