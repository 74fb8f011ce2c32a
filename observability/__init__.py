"""What the deployment measures and how it is read back. No torch.

metrics.py             each process's prometheus-client registry and its publisher to Redis
stage_metrics.py       what every CPU stage's loop measures
deployment_metrics.py  the one /metrics target: every process's figures read from Redis
deployment_status.py   the live picture behind `streamserve status` and /status
cluster_status.py      that picture over a Redis Cluster's shards, joined
stream_stats.py        the streams' XINFO figures
redis_server.py        the Redis server's own figures (commands, CPU, memory, clients)
"""
