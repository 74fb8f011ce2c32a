"""KV memory: where every token's keys and values live, and the prefixes kept for reuse.

req_to_token_pool.py  one row per running request: token position -> KV slot
kv_pool.py            the K and V tensors of every layer, indexed by KV slot
allocator.py          KV slots handed out a page at a time
radix_cache.py        a prefix cache over token ids whose values are KV slots
gpu_memory.py         how many KV tokens a GPU holds once weights and graphs have theirs
"""
