"""The subspace codecs: each token's concatenated layers x [W] stored as its coordinates c = x U on
the top-k right singular vectors U [W, k] of a sample of the same target's states, then encoded by an
inner codec (the name after `subspace-`) as a [T, k] tensor whose "layers" are groups of GROUP
coordinates (each group gets its own fp8/fp4 scale, so one large coordinate costs the others nothing).

The drafter reads the target's states only through `fc` (W*x, no bias), so it trains on c with an
`fc` of k inputs and exports W_full = W_k U^T: on a full state x, W_full x = W_k U^T x = W_k c. The
states are not centred: a mean subtracted before projecting would need a bias in `fc` to fold back.
U lives in the cache as target/subspace.safetensors (float32, tensor `basis`); its sha256 is part
of the spec, so caches of two bases never mix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cache.errors import DFlashCacheError

if TYPE_CHECKING:
    import torch

PREFIX = "subspace-"
GROUP = 64  # coordinates per scale of the inner codec
BASIS_FILE = "subspace.safetensors"  # in the cache's target/ folder
BASIS_TENSOR = "basis"


def is_subspace(codec: str) -> bool:
    return codec.startswith(PREFIX)


def inner_codec(codec: str) -> str:
    return codec[len(PREFIX) :] if is_subspace(codec) else codec


def inner_groups(rank: int) -> int:
    """The inner codec's "layers": one per GROUP coordinates."""
    return rank // GROUP


@dataclass
class SubspaceOptions:
    """How a basis is fitted (extract/options.py holds the defaults and the command line's help)."""

    sample: Path  # a cache of the same target and layers (any codec) whose states the basis is fitted on
    rank: int | None  # k; None: the least multiple of GROUP that keeps `energy`
    energy: float  # share of a token's sum of squares the coordinates keep, on average
    sample_tokens: int  # tokens of the sample read (its first samples)


def check_options(opts: SubspaceOptions, width: int) -> None:
    if opts.rank is not None and (opts.rank < GROUP or opts.rank % GROUP or opts.rank > width):
        raise DFlashCacheError(
            f"--subspace-rank must be a multiple of {GROUP} between {GROUP} and the states' width {width}, got {opts.rank}"
        )
    if not 0 < opts.energy <= 1:
        raise DFlashCacheError(f"--subspace-energy must be in (0, 1], got {opts.energy}")


def gram(chunks: Iterable[torch.Tensor], device) -> tuple[torch.Tensor, int]:
    """Sum of x^T x over [n, W] chunks, in float64 (the sum of squares of massive dimensions, 10^4
    each, over 10^5 tokens, loses the small directions in float32); and the token count."""
    import torch

    total, tokens = None, 0
    for chunk in chunks:
        x = chunk.to(device=device, dtype=torch.float64)
        total = x.T @ x if total is None else total.addmm_(x.T, x)
        tokens += x.shape[0]
    if total is None:
        raise DFlashCacheError("the subspace sample holds no tokens")
    return total, tokens


def token_shares(chunks: Iterable[torch.Tensor], vectors: torch.Tensor) -> torch.Tensor:
    """[W]: entry j-1 is the mean over the tokens of the share of a token's sum of squares that the
    first j vectors keep. A few massive dimensions (|x| ~ 10^4) hold nearly all of the sample's sum
    of squares, so its share says little about the other dimensions of each token; this does."""
    import torch

    total, tokens = torch.zeros(vectors.shape[1], dtype=vectors.dtype, device=vectors.device), 0
    for chunk in chunks:
        x = chunk.to(device=vectors.device, dtype=vectors.dtype)
        kept = (x @ vectors).square().cumsum(1) / x.square().sum(1, keepdim=True).clamp_min(1e-300)
        total += kept.sum(0)
        tokens += x.shape[0]
    return total / max(tokens, 1)


def fit_basis(
    g: torch.Tensor, rank: int | None, energy: float, chunks: Iterable[torch.Tensor] | None = None
) -> tuple[torch.Tensor, float]:
    """Top right singular vectors of the sample (eigenvectors of its Gram matrix g), largest first:
    (float32 [W, k], the share of the sum of squares they keep). The share is the sample's, or with
    `chunks` (the sample again) the mean of each token's (`token_shares`); `energy` applies to it."""
    import torch

    values, vectors = torch.linalg.eigh(g)  # ascending
    values, vectors = values.flip(0).clamp_min(0), vectors.flip(1)
    kept = values.cumsum(0) / values.sum().clamp_min(1e-300) if chunks is None else token_shares(chunks, vectors)
    if rank is None:
        needed = int((kept < energy).sum()) + 1
        rank = min(math.ceil(needed / GROUP) * GROUP, g.shape[0])
    return vectors[:, :rank].float().cpu().contiguous(), float(kept[rank - 1])


def sample_chunks(cache, max_tokens: int) -> Iterable[torch.Tensor]:
    """The first samples of an opened cache, up to `max_tokens` tokens, as decoded [n, W] states."""
    seen = 0
    for sample_id in sorted(cache):
        if seen >= max_tokens:
            return
        hidden = cache[sample_id].hidden[: max_tokens - seen]
        seen += hidden.shape[0]
        yield hidden


def save_basis(basis: torch.Tensor, path: Path) -> None:
    from dflash_cache.files.safetensors_file import save_tensors

    save_tensors({BASIS_TENSOR: basis.float().contiguous()}, path)


def load_basis(path: Path, width: int, rank: int) -> torch.Tensor:
    """The float32 [width, rank] basis a cache holds, its shape checked (the file may come from anyone)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            if BASIS_TENSOR not in f.keys() or f.get_slice(BASIS_TENSOR).get_shape() != [width, rank]:
                raise DFlashCacheError(f"{path} does not hold a {width} x {rank} tensor {BASIS_TENSOR!r}")
            basis = f.get_tensor(BASIS_TENSOR)
    except (SafetensorError, OSError) as e:
        raise DFlashCacheError(f"{path}: unreadable subspace basis ({e}); rerun extract") from None
    return basis.float()


def basis_path(cache_root: Path) -> Path:
    return Path(cache_root) / "target" / BASIS_FILE


def spec_basis(spec: dict, target_dir: Path, device="cpu") -> torch.Tensor | None:
    """The basis of a cache of `spec` whose target/ folder is `target_dir`, on `device` (None for
    the other codecs)."""
    if not is_subspace(spec["codec"]):
        return None
    width = len(spec["layer_ids"]) * spec["target"]["hidden_size"]
    return load_basis(Path(target_dir) / BASIS_FILE, width, spec["subspace"]["rank"]).to(device)


def project(hidden: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """bf16 [T, W] states -> bf16 [T, k] coordinates (the product in float32)."""
    import torch

    return (hidden.float() @ basis.to(hidden.device)).to(torch.bfloat16)


def fold(fc_weight: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """`fc` trained on coordinates [H, k] -> the reference layout's [H, W] (W_k U^T), in float32."""
    return fc_weight.float() @ basis.float().T
