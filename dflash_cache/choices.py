"""Values the commands offer as choices, kept here so that `--help` lists them without importing
torch or transformers (the modules that use them import them from here)."""

from pathlib import Path

# subspace-C: coordinates on a basis fitted to the target's states, coded by C (store/subspace.py)
CODECS = ("bf16", "bf16-zstd", "fp8-zstd", "fp4", "fp4-zstd", "subspace-bf16-zstd", "subspace-fp8-zstd", "subspace-fp4")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")  # weights of `export`
TARGET_DTYPES = ("float32", "bfloat16")  # the target of `eval --target`
# the drafter's training objectives (drafter/loss.py). The first, DFlash's own, is what the library's
# functions take when given none, and what a run that records no loss trained with (its default until
# DEFAULT_LOSS); `train` defaults to DEFAULT_LOSS, which led it on a real target at every seed tried
# (BENCHMARKS.md, "Quality on a real target")
LOSSES = ("dflash", "dpace", "topk")
DEFAULT_LOSS = "dpace"
# the drafter's optimizers (train/optim.py), each with its default (learning rate, weight decay). The first is
# what the library's functions take when given none, and what a run that records no optimizer trained with (its
# default until DEFAULT_OPTIMIZER); `train` defaults to DEFAULT_OPTIMIZER, speculators 0.9.0's, which beat AdamW
# on a real target at every seed tried (BENCHMARKS.md, "Quality on a real target")
OPTIMIZERS = ("adamw", "muon")
OPTIMIZER_DEFAULTS = {"adamw": (6e-4, 0.01), "muon": (1e-3, 0.1)}
DEFAULT_OPTIMIZER = "muon"
DPACE_ALPHA = 0.5  # D-PACE's smoothing: the default of speculators 0.9.0, SpecForge and NVIDIA Model-Optimizer
DEMO_ASSETS = Path(__file__).resolve().parent.parent / "examples" / "assets"
DEMO_TRAIN_DATA = (
    "train_regenerated.jsonl",
    "train.jsonl",
)  # in DEMO_ASSETS/data: the target's own answers, or the bundled ones
# 400, not 600: a step on the regenerated answers (shorter, so more of them per batch) costs more than
# one on the bundled answers, and the drafter is already far better after 400 (BENCHMARKS.md)
DEMO_STEPS = 400
# The help of --num-draft-layers (extract, train --live-target); target/target.py's resolve_layer_ids applies it.
LAYER_RULE = (
    "Capture N target layers: the middle one (num_layers // 2) for N=1; else N spread evenly over "
    "layers 1..num_layers-3 (the reference DFlash rule), or over all layers 0..num_layers-1 when the "
    "target has fewer than N+3 layers. Default when --layers is not given: 5, or every layer of a "
    "target with fewer than 5."
)
