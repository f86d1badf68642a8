"""speculators 0.9.0's DFlash trainer on the quality benchmark's data: the same regenerated
conversations and target hidden states, the same drafter shape and token budget.

    python -m benchmarks.peer_speculators to-peer CACHE OUT        # needs `datasets` (speculators' own)
    python -m benchmarks.peer_speculators to-export CHECKPOINT LIKE OUT

speculators trains from a folder its vLLM extraction writes: a `datasets` table (input_ids,
loss_mask, seq_len) and hidden_states/hs_I.safetensors per sample, holding the target layers it
feeds the drafter plus the last layer, whose output it turns into the target's logits. `to-peer`
writes that folder from a dflash-cache cache extracted with those layers (the last one last), so
both trainers read the same bytes. `to-export` turns a speculators DFlash checkpoint into the
reference layout that `dflash-cache eval` reads, with the config of one of our exports (LIKE) for
the same shape: both libraries name the drafter's weights as the reference does.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# speculators writes the verifier's own tensors too (loaded again from the verifier on load)
PEER_ONLY = ("verifier_norm.", "verifier_lm_head.", "embed_tokens.", "lm_head.", "d2t", "t2d")


def to_peer(cache_dir: Path, out: Path) -> None:
    from datasets import Dataset

    import dflash_cache

    cache = dflash_cache.open_cache(str(cache_dir))
    layers = len(cache.spec["layer_ids"])
    states = out / "hidden_states"
    states.mkdir(parents=True, exist_ok=True)
    columns: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(cache)):
        sample = cache[i]
        length = sample.input_ids.shape[0]
        hidden = sample.hidden.reshape(length, layers, -1).contiguous()
        save_file(
            {"hidden_states": hidden, "token_ids": sample.input_ids.to(torch.int64)}, states / f"hs_{i}.safetensors"
        )
        columns["input_ids"].append(sample.input_ids.tolist())
        columns["loss_mask"].append(sample.loss_mask.to(torch.int64).tolist())
        columns["seq_len"].append(length)
    dataset = Dataset.from_dict(columns)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    print(f"{len(cache)} samples, {sum(columns['seq_len']):,} tokens, {layers} layers -> {out}")


def to_export(checkpoint: Path, like: Path, out: Path) -> None:
    weights = load_file(str(checkpoint / "model.safetensors"))
    peer_config = json.loads((checkpoint / "config.json").read_text())
    config = json.loads((like / "config.json").read_text())
    kept = {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items() if not k.startswith(PEER_ONLY)}
    ours = set(load_file(str(like / "model.safetensors")))
    if set(kept) != ours:
        raise SystemExit(
            f"weights differ from the reference layout: only in speculators' {sorted(set(kept) - ours)[:6]}, "
            f"only in ours {sorted(ours - set(kept))[:6]}"
        )
    config["block_size"] = peer_config.get("block_size", config["block_size"])
    config["dflash_config"]["target_layer_ids"] = peer_config.get(
        "aux_hidden_state_layer_ids", config["dflash_config"]["target_layer_ids"]
    )
    config["dflash_config"]["mask_token_id"] = peer_config.get(
        "mask_token_id", config["dflash_config"]["mask_token_id"]
    )
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(
        f"{len(kept)} tensors, block {config['block_size']}, layers {config['dflash_config']['target_layer_ids']} -> {out}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    peer = commands.add_parser("to-peer")
    peer.add_argument("cache", type=Path)
    peer.add_argument("out", type=Path)
    export = commands.add_parser("to-export")
    export.add_argument("checkpoint", type=Path)
    export.add_argument("like", type=Path)
    export.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.command == "to-peer":
        to_peer(args.cache, args.out)
    else:
        to_export(args.checkpoint, args.like, args.out)


if __name__ == "__main__":
    main()
