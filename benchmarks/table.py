"""Print one table of the figures in the JSON files that benchmarks/run_all.sh writes.

python benchmarks/table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(out: Path, name: str) -> dict | None:
    path = out / name
    if not path.is_file():
        return None
    text = path.read_text().strip()
    try:
        return json.loads(text.splitlines()[-1] if name == "peer.json" else text)
    except (json.JSONDecodeError, IndexError):
        return None


def main() -> None:
    out = Path(sys.argv[1])
    rows = ["| figure | configuration | value | goal |", "| --- | --- | --- | --- |"]
    for name, label in [
        ("extract_qwen3_8b.json", "Qwen3-8B shape"),
        ("extract_qwen3_5_cut.json", "qwen3_5 hybrid, 27B shape cut"),
    ]:
        if e := load(out, name):
            config = (
                f"{label}, {e['layers']} layers, {e['tokens']:,} tokens, batches <= {e['batch_tokens']}, {e['codec']}"
            )
            rows.append(
                f"| extraction / bare forward | {config} | {e['extract_tok_s']:,.0f} / {e['bare_tok_s']:,.0f} tok/s = {e['ratio']:.3f} (host tail {e['host_tail_s']:.1f} s; {e['ratio_without_tail']:.3f} without it) | >= 0.95: {'met' if e['ratio'] >= 0.95 else 'not met'} |"
            )
            rows.append(f"| bytes per token stored | {config} | {e['bytes_per_token']:,.0f} | |")
            if sizes := e.get("codec_bytes_per_token"):
                rows.append(
                    f"| bytes per token by codec | {label}, one batch of its captured layers | "
                    + ", ".join(f"{c} {v:,.0f}" for c, v in sizes.items())
                    + " | |"
                )
    drafter, peer = load(out, "drafter.json"), load(out, "peer.json")
    for r in (drafter or {}).get("results", []):
        config = f"qwen3.6-27b preset, {r['tokens_per_step']:.0f} tokens, {r['anchors_per_step']:.0f} anchors per step"
        rows.append(
            f"| drafter tokens/s, {r['mode']} | {config} | {r['tokens_per_s']:,.0f} (MFU {r['mfu']:.1%}, masks {r['mask_share']:.1%} of step) | |"
        )
        if peer:
            ratio = r["tokens_per_s"] / peer["real_tokens_per_s"]
            rows.append(
                f"| drafter / peer, {r['mode']} | speculators {peer['speculators']}, same shape, {peer['anchors_per_step']} anchors | {ratio:.2f}x ({peer['real_tokens_per_s']:,.0f} tok/s peer) | >= 1.15x: {'met' if ratio >= 1.15 else 'not met'} |"
            )
    if t := load(out, "train.json"):
        rows.append(
            f"| cache-fed / memory-fed | qwen3.6-27b preset, eager, bf16-zstd cache on local disk | {t['cache_tok_s']:,.0f} / {t['memory_tok_s']:,.0f} tok/s = {t['ratio']:.3f} | >= 0.97: {'met' if t['ratio'] >= 0.97 else 'not met'} |"
        )
        peaks = {int(k): v for k, v in t["peak_gb"].items()}
        first, last = peaks[min(peaks)], peaks[max(peaks)]
        growth = last / first - 1
        rows.append(
            f"| peak GPU memory, step {min(peaks)} / {max(peaks)} | small drafter, a new batch shape every step | {first:.3f} / {last:.3f} GB ({growth:+.2%}) | within 2%: {'met' if abs(growth) <= 0.02 else 'not met'} |"
        )
    if c := load(out, "coupled.json"):
        config = (
            f"{c['shape']} target on GPU 0 feeding a {c['drafter']} drafter (hidden {c['drafter_hidden']}) on GPU 1, "
            f"vs 2 DDP ranks from a bf16-zstd cache; batches of {c['tokens_per_batch']} tokens, <= {c['max_anchors']} anchors per sequence"
            + (", all on the CPU (a smoke test)" if c["device"] == "cpu" else "")
        )
        rows.append(
            f"| cache / coupled training tokens/s | {config} | {c['cache_tok_s']:,.0f} / {c['coupled_tok_s']:,.0f} tok/s = {c['ratio']:.2f}x | >= 2x: {'met' if c['ratio'] >= 2 else 'not met'} |"
        )
        peak = c["peak_gb"]
        rows.append(
            f"| peak GPU memory, coupled / cache | same runs | target {peak['coupled_target']:.1f} GB + drafter {peak['coupled_drafter']:.1f} GB / {peak['cache_rank0']:.1f} GB per rank | |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
