"""Running a model: `fivefold generate` (a file of prompts) and `fivefold serve` (an OpenAI-compatible server).

    engine.py (rank 0 / the launching process): requests, the batching Scheduler of each replica, sampling
    executor.py: runs a step on one replica, in this process (tp1 pp1) or on worker processes (workers.py)
    runner.py: one pipeline stage of the model over a paged KV cache (kv_cache.py), tp shards (shard.py)
"""
