"""`inspect`: what a cache holds, in lines a person reads."""

from __future__ import annotations

from dflash_cache.choices import CODECS
from dflash_cache.console.units import size
from dflash_cache.data.plan import describe_plan, plan_batches
from dflash_cache.store.cache import Cache
from dflash_cache.store.disk_need import bytes_per_token
from dflash_cache.store.subspace import is_subspace


def describe_cache(cache: Cache, token_budget: int) -> list[str]:
    spec, totals = cache.spec, cache.manifest["totals"]
    target = spec["target"]
    tokens = max(totals["tokens"], 1)
    lines = [
        f"cache:        {cache.root}",
        f"target:       {target['name']} ({target['model_type']}, {target['num_layers']} layers, hidden {target['hidden_size']}, vocab {target['vocab_size']})",
        f"layers:       {spec['layer_ids']}",
        f"codec:        {spec['codec']}" + (f", top-{spec['topk']} labels" if spec.get("topk") else ""),
        f"samples:      {totals['samples']:,} ({len(cache.manifest['skipped'])} skipped, {cache.manifest.get('extract', {}).get('truncated', 0)} truncated at {spec['max_length']} tokens)",
        f"tokens:       {totals['tokens']:,}",
        _record_id_line(cache),
        *_data_lines(cache.manifest.get("extract", {})),
        f"shards:       {len(cache.shards)}, {size(totals['bytes'])}",
        f"bytes/token:  {totals['bytes'] / tokens:,.0f} (hidden states {totals['hidden_bytes'] / tokens:,.0f}, raw bf16 {totals['raw_hidden_bytes'] / tokens:,.0f})",
        f"compression:  {totals['hidden_bytes'] / max(totals['raw_hidden_bytes'], 1):.3f} of raw bf16",
        "disk for these tokens with each codec (estimated as extract does before it starts):",
        *["  " + line for line in disk_by_codec(spec, totals["tokens"])],
        f"plan at a token budget of {token_budget:,}:",
    ]
    lengths = cache.lengths()
    ids = sorted(lengths)
    batches = plan_batches(ids, [lengths[i] for i in ids], token_budget, seed=None)
    return lines + ["  " + line for line in describe_plan(batches, lengths)]


def disk_by_codec(spec: dict, tokens: int) -> list[str]:
    """One line per codec but the subspace ones (whose size is their rank's: --subspace-rank k
    takes about k values a token)."""
    lines = []
    for codec in CODECS:
        if is_subspace(codec):
            continue
        per_token = bytes_per_token({**spec, "codec": codec})
        lines.append(f"{codec:<10} {size(int(per_token * tokens)):>10} ({per_token:,.0f} bytes a token)")
    return lines


def _record_id_line(cache: Cache) -> str:
    """How many samples carry their record's own `id`, and whether every id names one sample."""
    index = cache.record_ids()
    if not index:
        return "record ids:   none (the data's records have no `id`; look samples up by sample id)"
    shared = [sids for sids in index.values() if isinstance(sids, list)]
    held = len(index) - len(shared) + sum(len(s) for s in shared)
    line = f"record ids:   {held:,} of {len(cache):,} samples (e.g. {next(iter(index))!r})"
    if not shared:
        return line + ", each naming one sample"
    return (
        line + f"; {sum(len(s) for s in shared):,} records share an id with another "
        "(such an id names no sample: look those up by sample id)"
    )


def describe_sample(cache: Cache, key: int | str) -> list[str]:
    """One sample: its ids, where it is stored, its tokens (reads and checks its row)."""
    sample_id = cache.sample_id(key)
    shard, row = cache.location(sample_id)
    stored = cache.read_stored(sample_id)
    record_id = cache.record_id(sample_id)
    return [
        f"sample:       {sample_id}" + (f" (record id {record_id!r})" if record_id is not None else " (no record id)"),
        f"stored:       {cache.shards[shard].path}, row {row} (checksum verified)",
        f"tokens:       {len(stored.input_ids):,}, {int(stored.loss_mask.sum()):,} trained on",
    ]


def _data_lines(report: dict) -> list[str]:
    """What extraction found in the data: masked tokens by kind, records left out, template fidelity."""
    lines = []
    masked = report.get("masked_tokens")
    if masked:
        total = max(sum(masked.values()), 1)
        kinds = ", ".join(f"{kind.replace('_', ' ')} {n:,} ({n / total:.1%})" for kind, n in masked.items())
        lines.append(f"masked:       {sum(masked.values()):,} tokens: {kinds}")
    left_out = [
        (len(report.get("bad_records", [])), "bad records"),
        (len(report.get("untrainable", [])), "with nothing to train on"),
    ]
    if any(n for n, _ in left_out):
        lines.append("left out:     " + ", ".join(f"{n} {what}" for n, what in left_out) + " (listed in the manifest)")
    unfaithful = report.get("unfaithful", {})
    if unfaithful.get("count"):
        lines.append(
            f"template:     {unfaithful['count']} conversations not rendered as the data has them, e.g. {unfaithful['examples'][0]}"
        )
    return lines
