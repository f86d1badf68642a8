"""Write the small frozen target pieces a drafter shares (embeddings, final norm, LM head) and the
target's config and tokenizer into a cache's `target/` folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dflash_cache.files.safetensors_file import save_tensors
from dflash_cache.target.target import Target


def norm_weight_offset(norm: torch.nn.Module, eps: float) -> float:
    """0.0 if the RMSNorm scales by `weight` (Llama, Qwen3), 1.0 if by `1 + weight` (Qwen3.5).

    Found by running the module rather than by model name, so new architectures need no list.
    """
    weight = norm.weight.detach().float()
    x = torch.randn(4, weight.shape[0], generator=torch.Generator().manual_seed(0))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    with torch.inference_mode():
        out = norm(x.to(norm.weight)).float().cpu()
    errors = {offset: (out - normed * (offset + weight.cpu())).abs().max().item() for offset in (0.0, 1.0)}
    return min(errors, key=errors.get)


def save_target_files(target: Target, out_dir: str | Path) -> None:
    """config.json (the target's own, byte for byte, so its sha256 matches `target.config_hash`),
    tokenizer files, head.safetensors and head.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(target.path / "config.json", out_dir / "config.json")
    target.tokenizer.save_pretrained(out_dir)
    model = target.model
    norm = target.base.norm
    # clone(): tied embeddings share storage with lm_head, which safetensors refuses to save twice.
    tensors = {
        "embed_tokens.weight": model.get_input_embeddings().weight,
        "norm.weight": norm.weight,
        "lm_head.weight": model.get_output_embeddings().weight,
    }
    tensors = {name: t.detach().to("cpu", torch.bfloat16).contiguous().clone() for name, t in tensors.items()}
    save_tensors(tensors, out_dir / "head.safetensors")
    eps = float(target.config.rms_norm_eps)
    head = {
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": eps,
        "norm_weight_offset": norm_weight_offset(norm, eps),
    }
    (out_dir / "head.json").write_text(json.dumps(head, indent=2) + "\n")
