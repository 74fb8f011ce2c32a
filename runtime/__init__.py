"""What every process runs on: its settings, the embedded Redis-protocol server, child
processes, and the model's files. No torch; imports nothing else of the project.

config.py           `BusConfig`: every stream and key name, every tunable (`STREAMSERVE_*`)
key_ids.py          what may be an id in a key name (a worker's, a replica's, a shard's)
cluster.py          a Redis Cluster as shards, one per primary; a process attaches to one
embedded_server.py  the private server `streamserve up` starts (unix socket, append-only file)
child_process.py    children that stop in their parent's order
model_files.py      a `--model` argument resolved to its files (worker and tokenizer alike)
gguf_header.py      a GGUF file's header metadata, read key by key without loading it
context_length.py   the model's context length, from config.json or the GGUF header
task_cancel.py      cancellations not lost: at shutdown, and in a request's handler
gc_tuning.py        the garbage collector's settings for a long-running stage process
event_loop.py       the event loop an asyncio process runs on: uvloop where installed
"""
