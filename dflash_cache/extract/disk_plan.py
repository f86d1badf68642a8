"""What a data file's cache would take on disk, codec by codec, before anything is extracted: the
data tokenized (and kept, as `extract` keeps it) for the target, its tokens counted."""

from __future__ import annotations

from pathlib import Path

from dflash_cache.extract.events import ExtractEvents
from dflash_cache.extract.options import ExtractOptions
from dflash_cache.extract.pipeline import _tokenized
from dflash_cache.store.inspect import disk_by_codec
from dflash_cache.target.info import read_target_info
from dflash_cache.target.target import resolve_layer_ids


def describe_data_disk(target: Path, data: list[Path], layers: list[int] | None = None) -> list[str]:
    opts = ExtractOptions(target=target, data=data, out="", layers=layers)
    info = read_target_info(opts.target)
    layer_ids = resolve_layer_ids(info.num_layers, opts.layers, opts.num_draft_layers)
    tokens = int(_tokenized(opts, ExtractEvents()).lengths.sum())
    spec = {"layer_ids": layer_ids, "target": {"hidden_size": info.hidden_size}, "topk": opts.topk}
    return [
        f"data:         {', '.join(map(str, data))}: {tokens:,} tokens within --max-length {opts.max_length}",
        f"target:       {target} (layers {layer_ids}, hidden {info.hidden_size})",
        "disk with each codec (estimated as extract does before it starts):",
        *["  " + line for line in disk_by_codec(spec, tokens)],
    ]
