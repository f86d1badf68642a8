"""Who sees whom in the drafter's attention over a packed batch, as a flex-attention BlockMask.

Keys are the N context tokens of the packed batch followed by the A*B block tokens (block j takes
keys N + j*B .. N + j*B + B-1); queries are the block tokens. A query of block j sees:
  - context keys of its own sequence at positions before block j's anchor, and
  - keys of block j itself;
and on sliding-window layers only keys at positions p with p <= its own position and
(its position - p) < window, which makes the block causal and bounds the context.

The BlockMask's tile lists and its mask function are computed from each query's two key intervals
(no dense [Q, KV] mask is ever built); `dense_mask` evaluates the rule itself (`visible`) on the full
grid for the reference attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask


@dataclass
class BlockLayout:
    """Per-query and per-key coordinates of one batch (sequence id, position, block id).

    The arrays are padded to `padded_q` / `padded_kv` entries so that a mask function may index them
    anywhere inside the last, partial tile; padding queries and keys belong to no sequence.
    """

    num_context: int  # N
    num_queries: int  # Q = A * B
    block_size: int
    q_seq: torch.Tensor  # [padded_q] sequence id of the query (-1: padding)
    q_pos: torch.Tensor  # [padded_q] position inside its sequence
    q_anchor: torch.Tensor  # [padded_q] packed index of the query's anchor
    q_start: torch.Tensor  # [padded_q] packed index of the first token of its sequence
    q_block: torch.Tensor  # [padded_q]
    q_slot: torch.Tensor  # [padded_q] index inside the block
    q_first_key: torch.Tensor  # [padded_q] packed index of its block's first key (-block_size: padding)
    kv_seq: torch.Tensor  # [padded_kv] (-2: padding)
    kv_pos: torch.Tensor  # [padded_kv]
    kv_block: torch.Tensor  # [padded_kv] block id of a block key, -1 for a context key

    @property
    def num_keys(self) -> int:
        return self.num_context + self.num_queries

    @classmethod
    def build(
        cls, seq_ids: torch.Tensor, positions: torch.Tensor, anchors: torch.Tensor, block_size: int, tile: int = 128
    ) -> BlockLayout:
        n, a, b = seq_ids.shape[0], anchors.shape[0], block_size
        device = seq_ids.device
        q, kv = a * b, n + a * b
        pad_q, pad_kv = -q % tile, -kv % tile

        def per_query(per_block: torch.Tensor, fill: int) -> torch.Tensor:
            values = per_block[:, None].expand(a, b).reshape(q)
            return torch.cat([values, values.new_full((pad_q,), fill)])

        slot = torch.arange(b, device=device)[None, :].expand(a, b).reshape(q)
        q_block = per_query(torch.arange(a, device=device), -1)
        q_slot = torch.cat([slot, slot.new_zeros(pad_q)])
        q_anchor = per_query(anchors, 0)
        q_start = per_query(anchors - positions[anchors], 0)
        q_seq = per_query(seq_ids[anchors], -1)
        q_pos = per_query(positions[anchors], 0) + q_slot
        q_first_key = per_query(n + torch.arange(a, device=device) * b, -b)
        kv_seq = torch.cat([seq_ids, q_seq[:q], seq_ids.new_full((pad_kv,), -2)])
        kv_pos = torch.cat([positions, q_pos[:q], positions.new_zeros(pad_kv)])
        kv_block = torch.cat([q_block.new_full((n,), -1), q_block[:q], q_block.new_full((pad_kv,), -1)])
        return cls(n, q, b, q_seq, q_pos, q_anchor, q_start, q_block, q_slot, q_first_key, kv_seq, kv_pos, kv_block)


def visible(layout: BlockLayout, q: torch.Tensor, kv: torch.Tensor, window: int | None) -> torch.Tensor:
    """The attention rule, elementwise over (broadcast) query and key indices."""
    same_sequence = layout.kv_seq[kv] == layout.q_seq[q]
    context = kv < layout.q_anchor[q]  # a context key before the anchor (block keys sit after all context)
    own_block = layout.kv_block[kv] == layout.q_block[q]
    see = same_sequence & (context | own_block)
    if window is not None:
        distance = layout.q_pos[q] - layout.kv_pos[kv]
        see = see & (distance >= 0) & (distance < window)
    return see


def dense_mask(layout: BlockLayout, window: int | None) -> torch.Tensor:
    """[Q, KV] boolean mask, for the reference attention (and CPU training, where flex has no backward)."""
    device = layout.q_seq.device
    q = torch.arange(layout.num_queries, device=device)[:, None]
    kv = torch.arange(layout.num_keys, device=device)[None, :]
    return visible(layout, q, kv, window)


def key_intervals(layout: BlockLayout, q: torch.Tensor | slice, window: int | None) -> tuple[torch.Tensor, ...]:
    """For queries `q` (indices or a slice): the packed-key intervals [lo, hi) each sees, context then own block (empty for
    padding queries); the same rule as `visible`."""
    ctx_lo, ctx_hi = layout.q_start[q], layout.q_anchor[q]
    blk_lo = layout.q_first_key[q]
    blk_hi = blk_lo + layout.block_size
    if window is not None:
        slot = layout.q_slot[q]
        reach = slot - window + 1  # the oldest visible key is `window - 1` positions back
        ctx_lo = torch.maximum(ctx_lo, ctx_hi + reach)
        blk_hi = blk_lo + slot + 1
        blk_lo = blk_lo + reach.clamp_min(0)
    return ctx_lo, ctx_hi, blk_lo, blk_hi


def _tile_counts(q_tile: torch.Tensor, first: torch.Tensor, end: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """For each (query tile, key tile): how many queries of the tile mark key tiles first..end-1."""
    rows, cols = shape
    diff = torch.zeros(rows * (cols + 1), dtype=torch.int32, device=q_tile.device)
    ones = (end > first).to(torch.int32)
    diff.scatter_add_(0, q_tile * (cols + 1) + first.clamp(0, cols), ones)
    diff.scatter_add_(0, q_tile * (cols + 1) + end.clamp(0, cols), -ones)
    return diff.view(rows, cols + 1).cumsum(1, dtype=torch.int32)[:, :cols]


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [Tq, Tkv] -> (count [1, 1, Tq], indices of the marked tiles first [1, 1, Tq, Tkv])."""
    count = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
    return count[None, None], order.to(torch.int32)[None, None]


def block_mask(layout: BlockLayout, window: int | None, tile: int = 128, group: int = 1) -> BlockMask:
    """The flex-attention BlockMask: tiles with no visible pair are skipped, tiles where every
    query sees every key skip the mask function.

    Its rows are queries x `group`: row r is query r // group. Attention with `group` query heads per
    key head (GQA) runs each key head once over its group's query rows packed together
    (`drafter/attention.py`), so that a tile of rows spans `group` times fewer queries, whose key
    intervals overlap more: on the 27B drafter's batches a group of 4 covers 13% fewer pairs and half
    the partial tiles (benchmarks/mask_density.py)."""
    if tile % group:
        raise ValueError(f"a tile of {tile} rows does not hold whole groups of {group}")
    q, per_tile = layout.num_queries, tile // group
    shape = (-(-q // per_tile), -(-layout.num_keys // tile))
    index = torch.arange(q, device=layout.q_seq.device)
    q_tile = index // per_tile  # the group's rows of a query share its tile
    ctx_lo, ctx_hi, blk_lo, blk_hi = key_intervals(layout, slice(0, q), window)  # every real query

    def overlapping(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = lo // tile
        return first, torch.where(hi > lo, (hi - 1) // tile + 1, first)

    touched = _tile_counts(q_tile, *overlapping(ctx_lo, ctx_hi), shape)
    touched += _tile_counts(q_tile, *overlapping(blk_lo, blk_hi), shape)
    covered = _tile_counts(q_tile, -(-ctx_lo // tile), ctx_hi // tile, shape)  # tiles inside [lo, hi)
    queries_per_tile = (q - torch.arange(shape[0], device=index.device) * per_tile).clamp(max=per_tile)
    full = covered == queries_per_tile[:, None].to(torch.int32)
    partial = (touched > 0) & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        # per query row four loads and none per key: cheaper in the kernels' partial tiles than `visible`
        # (benchmarks/flex_configs.py --mask-mods)
        lo, hi, first, last = key_intervals(layout, q_idx // group, window)
        return ((kv_idx >= lo) & (kv_idx < hi)) | ((kv_idx >= first) & (kv_idx < last))

    kv_count, kv_indices = _ordered(partial)
    full_count, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_count,
        kv_indices,
        full_count,
        full_indices,
        BLOCK_SIZE=tile,
        mask_mod=mask_mod,
        seq_lengths=(q * group, layout.num_keys),
    )


@dataclass
class BatchMasks:
    """One batch's layout and one mask per layer type, shared by all layers of that type; BlockMasks
    have `group` rows per query (block_mask)."""

    layout: BlockLayout
    by_type: dict[str, BlockMask | torch.Tensor]

    @classmethod
    def build(
        cls,
        layout: BlockLayout,
        layer_types: list[str],
        sliding_window: int | None,
        dense: bool = False,
        tile: int = 128,
        group: int = 1,
    ) -> BatchMasks:
        windows = {"full_attention": None, "sliding_attention": sliding_window}
        by_type = {}
        for kind in dict.fromkeys(layer_types):
            by_type[kind] = (
                dense_mask(layout, windows[kind]) if dense else block_mask(layout, windows[kind], tile, group)
            )
        return cls(layout, by_type)
