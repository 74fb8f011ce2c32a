"""Who is asking, and what they may see and spend.

auth.py       API keys checked on every request
ownership.py  each key's owner: whose files, batches and requests it sees
tenants.py    keys to tenants, weights, limits, lowest priority (STREAMSERVE_KEY_LIMITS)
limits.py     concurrent sequences and tokens per minute, counted in Redis
"""
