"""`ExtractOptions`: every option of an extraction, each with its default and its `--help` text."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_cache.choices import CODECS, LAYER_RULE
from dflash_cache.console.options import option

# Tokens per target forward by device type. A CPU runs a 135M-parameter target at a few thousand
# tokens per second: rows of 4,096 tokens take seconds each, so progress moves row by row and the
# CPU's warm-up row (target/warmup.py) stays small.
TOKEN_BUDGETS = {"cuda": 49152, "cpu": 4096}


@dataclass(kw_only=True)
class ExtractOptions:
    target: Path = field(
        metadata=option("Hugging Face model directory of the target (run in bf16; in fp32 on a CPU slow at bf16).")
    )
    data: list[Path] = field(
        metadata=option(
            "Conversations JSONL ({'messages': [...]} or ShareGPT {'conversations': [...]}), or pre-tokenized "
            "Parquet/Arrow/JSONL with input_ids (and loss_mask). Repeatable."
        )
    )
    out: Path | str = field(  # a folder, or an fsspec URL written through `staging`
        metadata=option("Cache directory to create, or to resume; or an fsspec URL (s3://bucket/prefix, gs://...).")
    )
    layers: list[int] | None = field(
        default=None,
        metadata=option("Target layer indices to capture, e.g. 1,16,31,46,61 (0-based; layer i's output)."),
    )
    num_draft_layers: int | None = field(default=None, metadata=option(LAYER_RULE))
    codec: str = field(
        default="bf16-zstd",
        metadata=option(
            "bf16-zstd and bf16 are lossless; fp8-zstd is lossy, about 0.42x raw bf16; fp4 and fp4-zstd (4-bit "
            "values with a scale per 16) are lossier, about 0.28x. subspace-C stores each token's coordinates on "
            "a basis fitted to --subspace-sample, coded by C.",
            choices=CODECS,
        ),
    )
    subspace_sample: Path | None = field(
        default=None,
        metadata=option(
            "subspace codecs: a cache of this target and layers (e.g. a small bf16-zstd extraction) whose states "
            "the basis is fitted on."
        ),
    )
    subspace_rank: int | None = field(
        default=None,
        metadata=option(
            "subspace codecs: coordinates a token keeps (a multiple of 64). Default: as many as --subspace-energy "
            "needs.",
            minimum=64,
        ),
    )
    subspace_energy: float = field(
        default=0.999,
        metadata=option(
            "subspace codecs: the share of a token's sum of squares the coordinates keep, on average over the sample."
        ),
    )
    subspace_sample_tokens: int = 65536  # tokens of the sample the basis is fitted on (its first samples)
    check_disk: bool = field(
        default=True,
        metadata=option(
            "Start even when the output's file system looks too small for the cache (the estimate is stated "
            "either way).",
            flag="--skip-disk-check",
            invert=True,
        ),
    )
    gpus: list[int] | None = field(
        default=None,
        metadata=option(
            "GPUs to use, one process each, e.g. 0-4. Default: every visible GPU; the CPU when there is none."
        ),
    )
    token_budget: int | None = field(
        default=None,
        metadata=option(
            "Tokens (with padding) per target forward. Packed rows hold max(this, the longest sample) tokens. "
            f"Default: {TOKEN_BUDGETS['cuda']} on a GPU, {TOKEN_BUDGETS['cpu']} on the CPU."
        ),
    )
    max_length: int = field(
        default=8192, metadata=option("Longer samples are truncated (counted in the summary and manifest).")
    )
    topk: int = field(default=0, metadata=option("Also store the target's top-K ids and log-probs per position."))
    on_bad_sample: str = field(
        default="error",
        metadata=option(
            "A sample with NaN/Inf or an all-zero layer: stop, or skip it and list it in the manifest.",
            choices=("error", "skip"),
        ),
    )
    max_shard_bytes: int = field(
        default=512 << 20,
        metadata=option(
            "Shard size in MiB (a shard is closed once it reaches this size).",
            flag="--shard-size",
            unit=1 << 20,
            positive=True,
        ),
    )
    staging: Path | None = field(
        default=None,
        metadata=option(
            "With a URL --out: local folder for shards until they are uploaded. Default: under the temp folder."
        ),
    )
    tokenize_workers: int | None = field(
        default=None,
        metadata=option(
            "Processes tokenizing the data (0 or 1: the main process). Default: one per CPU core.", minimum=0
        ),
    )
    tokenized_dir: Path | None = field(
        default=None,
        metadata=option(
            "Where the tokenized data is kept, to be reused by resumed and later extractions of the same data, "
            "tokenizer and --max-length (an Arrow file that --data also reads). Default: "
            "$DFLASH_CACHE_TOKENIZED_DIR, else ~/.cache/dflash-cache/tokenized."
        ),
    )
    on_bad_record: str = field(
        default="error",
        metadata=option(
            "A malformed line, a record with nothing to train on or a chat-template error: stop naming file:line, "
            "or skip it (counted, and listed with file:line and reason in the manifest).",
            choices=("error", "skip"),
        ),
    )
    chat_template_kwargs: dict | None = field(
        default=None,
        metadata=option(
            "Extra chat-template options as a JSON object, e.g. '{\"enable_thinking\": false}' (part of the cache "
            "spec).",
            json_object=True,
            metavar="JSON",
        ),
    )
    strict_template: bool = field(
        default=False,
        metadata=option(
            "A conversation whose rendered turns differ from what generation sees (prompts that are not prefixes, "
            "no end-of-turn token) is a bad record, not a warning (a template that leaves out reasoning or tool "
            "calls always makes one)."
        ),
    )
    max_record_bytes: int | None = field(
        default=None,
        metadata=option(
            "JSONL lines longer than this are bad records, refused unread. Default: 256 bytes per --max-length "
            "token, at least 4 MiB.",
            minimum=1,
        ),
    )
    batching: str = field(
        default="auto",
        metadata=option(
            "packed: samples concatenated into rows of one fixed size, each sample seeing only itself (where exact "
            "for the target's family: dense qwen2, qwen3, llama, mistral, gemma3_text, MoE qwen3_moe, hybrid "
            "qwen3_5 and qwen3_5_moe); padded: one sample per row, on a few "
            "fixed shapes; auto: packed where exact.",
            choices=("auto", "packed", "padded"),
        ),
    )
    kernel_cache: Path | None = field(
        default=None,
        metadata=option(
            "Folder for compiled and autotuned kernels, kept between runs and shared by the ranks of a node (sets "
            "TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR). Default: Triton's own cache."
        ),
    )
    hash_weights: bool = field(
        default=True,
        metadata=option(
            "Identify the target's weights by their sizes, safetensors headers and 1 MiB sampled from each file, "
            "instead of hashing every byte once (recorded in the cache spec).",
            flag="--skip-weights-hash",
            invert=True,
        ),
    )
    tp: int = field(
        default=1,
        metadata=option(
            "Processes of a torchrun launch (all of them) that hold one copy of the target between them, split by "
            "transformers' tensor-parallel plan: a target larger than one GPU. Process 0 writes the cache."
        ),
    )
    compress_threads: int | None = None  # compression threads per rank; None: from the cores per process
