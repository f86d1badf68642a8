"""`regenerate`: the target answers the training conversations again, so a drafter learns what the
target itself says rather than what some other model wrote.

    conversations.py  which turns to regenerate; one conversation, turn by turn
    settings.py       the generation settings each output record carries, and their comparison
    output.py         the resumable JSONL output: whole lines only, a torn tail cut on restart
    client.py         OpenAI-compatible servers (vllm serve, SGLang, transformers serve): retries, backoff
    local.py          the target in-process through transformers, one replica per device
    run.py            the job: records fanned out to N requests in flight, written as they finish
"""
