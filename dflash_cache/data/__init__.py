"""Input data: read records, tokenize with an assistant-only loss mask, plan length-bucketed batches."""

from dflash_cache.data.dataset import LoadedData, Sample
from dflash_cache.data.plan import describe_plan, length_buckets, plan_batches, shard_for_rank
from dflash_cache.data.readers import Conversation, TokenRecord, read_records
from dflash_cache.data.tokenize import tokenize_conversation

__all__ = [
    "Conversation",
    "LoadedData",
    "Sample",
    "TokenRecord",
    "describe_plan",
    "length_buckets",
    "plan_batches",
    "read_records",
    "shard_for_rank",
    "tokenize_conversation",
]
