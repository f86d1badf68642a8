"""4-bit floats with a block scale: each value an e2m1 code (sign, 2 exponent bits, 1 mantissa bit:
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), each block of BLOCK values one float8 e4m3 scale, and each
token's layer one float32 scale so that the e4m3 scales, whose range is far narrower than the
activations' (massive dimensions reach 10^4 where others sit near 10^-2), stay in range. The layout
of the format GPUs use for weights; FORMAT.md has the spec. Both functions run on any device."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK = 16  # values per e4m3 scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitudes of the 8 codes; bit 3 of a code is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes, and whether a value exactly on one rounds up to the
# even code (ties to even, as IEEE rounding).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def token_bytes(width: int) -> int:
    """Bytes of one token's codes and block scales."""
    return width // 2 + width // BLOCK


def check_width(width: int, num_layers: int) -> None:
    if width % num_layers or (width // num_layers) % BLOCK:
        raise ValueError(f"fp4 needs each layer's width to be a multiple of {BLOCK}, got {width} over {num_layers}")


def encode(x: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/float [T, W] -> (uint8 [T, W/2 + W/BLOCK]: packed codes then block scales, fp32 [T, L])."""
    import torch

    t, width = x.shape
    check_width(width, num_layers)
    # In place where it can be: a sample of 8,192 tokens at the 27B shape is 840 MB a float32 copy,
    # on the GPU that holds the target.
    blocks = x.reshape(t, num_layers, -1, BLOCK)
    block_amax = torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg_()).float()  # [T, L, B]
    scales = block_amax.amax(dim=-1).clamp_min_(1e-30).div_(E2M1_MAX * E4M3_MAX)  # [T, L]
    block_scale = (block_amax / (E2M1_MAX * scales.unsqueeze(-1))).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block_scale.float().mul_(scales.unsqueeze(-1))  # the block's decoded scale
    live = step > 0
    q = blocks.float().div_(torch.where(live, step, 1.0).unsqueeze(-1)).abs_().clamp_(max=E2M1_MAX)
    q.mul_(live.unsqueeze(-1))  # a block whose scale is 0 codes every value as 0
    code = torch.zeros(q.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _MIDPOINTS:
        code += (q >= midpoint) if tie_up else (q > midpoint)
    del q
    code |= (blocks < 0).to(torch.uint8) << 3
    code = code.reshape(t, width)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    planes = torch.cat([packed, block_scale.reshape(t, -1).view(torch.uint8)], dim=1)
    return planes, scales


def decode(planes: torch.Tensor, scales: torch.Tensor, num_tokens: int, width: int) -> torch.Tensor:
    """Inverse of `encode`: bf16 [num_tokens, width] on planes' device."""
    import torch

    planes = planes.reshape(num_tokens, token_bytes(width))
    num_layers = scales.shape[1]
    packed, block_scale = planes[:, : width // 2], planes[:, width // 2 :]
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=planes.device)
    table = torch.cat([magnitudes, -magnitudes])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(num_tokens, num_layers, -1, BLOCK)
    step = block_scale.view(torch.float8_e4m3fn).float().reshape(num_tokens, num_layers, -1) * scales.unsqueeze(-1)
    return (table[codes.long()] * step.unsqueeze(-1)).to(torch.bfloat16).reshape(num_tokens, width)
