"""The basis of a subspace-coded extraction: fitted once, before the first forward, on the states of
a sample cache of the same target and layers, and kept in the cache's target/ folder, from which a
rerun takes it back (so a resumed run encodes with the same basis)."""

from __future__ import annotations

from collections.abc import Callable

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.resume import WritableCache
from dflash_cache.store.shard import file_sha256
from dflash_cache.store.subspace import (
    BASIS_FILE,
    SubspaceOptions,
    basis_path,
    check_options,
    fit_basis,
    gram,
    load_basis,
    sample_chunks,
    save_basis,
)


def _sample_cache(opts: SubspaceOptions, spec: dict):
    from dflash_cache.store.cache import open_cache

    cache = open_cache(opts.sample)
    theirs = cache.spec
    if theirs["target"]["config_hash"] != spec["target"]["config_hash"] or theirs["layer_ids"] != spec["layer_ids"]:
        raise DFlashCacheError(
            f"--subspace-sample {opts.sample} holds layers {theirs['layer_ids']} of target "
            f"{theirs['target']['name']!r}; the basis must be fitted on layers {spec['layer_ids']} of this target"
        )
    return cache


def prepare_basis(
    opts: SubspaceOptions | None,
    spec: dict,
    cache: WritableCache,
    device: str,
    distributed: bool,
    on_note: Callable[[str], None],
) -> dict:
    """The spec's `subspace` entry ({"rank", "sha256"}), the basis written to the cache's target/
    first if it is not there yet (taken from the remote cache when there is one)."""
    width = len(spec["layer_ids"]) * spec["target"]["hidden_size"]
    path, remote = basis_path(cache.root), cache.remote
    remote_name = f"target/{BASIS_FILE}"
    if not path.is_file() and remote is not None and remote.exists(remote_name):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(remote.read_bytes(remote_name))
    if path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            rank = f.get_slice("basis").get_shape()[-1]
        if opts is not None and opts.rank is not None and opts.rank != rank:
            raise DFlashCacheError(
                f"{path} holds a basis of rank {rank}, not --subspace-rank {opts.rank}; use another --out"
            )
        load_basis(path, width, rank)  # its shape checked
        return {"rank": rank, "sha256": file_sha256(path)}
    if opts is None:
        raise DFlashCacheError(
            f"--codec {spec['codec']} needs --subspace-sample: a cache of this target to fit the basis on"
        )
    if distributed:
        raise DFlashCacheError(
            "under torchrun every rank would fit its own subspace basis: run extract without torchrun "
            "(it runs on every visible GPU), or let such a run write the basis before launching torchrun"
        )
    check_options(opts, width)
    cache = _sample_cache(opts, spec)
    g, tokens = gram(sample_chunks(cache, opts.sample_tokens), device)
    basis, kept = fit_basis(g, opts.rank, opts.energy, sample_chunks(cache, opts.sample_tokens))
    del g
    if device.startswith("cuda"):  # the fit's GBs (a [W, W] float64 pair at W = 25,600) back to the ranks
        import torch

        torch.cuda.empty_cache()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_basis(basis, tmp)
    tmp.replace(path)
    on_note(
        f"subspace basis fitted on {tokens} tokens of {opts.sample}: {basis.shape[1]} of {width} dimensions "
        f"keep {kept:.4%} of a token's sum of squares (the mean over the sample's tokens)"
    )
    return {"rank": basis.shape[1], "sha256": file_sha256(path)}
