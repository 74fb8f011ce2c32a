"""The engine loop's scheduling: which requests run, in what batch, and what follows.

scheduler.py       `Scheduler`: admit, batch, run, sample, finish, one step at a time
outputs.py         a sampled token appended, stops checked, held-back text flushed
req.py             `Req`: one request as the scheduler tracks it
schedule_batch.py  the requests chosen for one forward, turned into a ForwardBatch
request_kv.py      KV slots moved between requests, the allocator and the prefix cache
policy.py          which waiting requests to admit first (priority classes first)
fair_share.py      weighted fair queueing between tenants within a class
pooling.py         embeddings: the hidden states a prefill pools, normalized into a vector
"""
