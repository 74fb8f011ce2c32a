"""Tensor parallelism: one worker's model split Megatron-style over `tp` ranks.

shard.py        `TPShard` and `ShardPlan`: which heads, MLP columns and vocabulary rows a
                rank holds, and the slice of each checkpoint tensor it loads
group.py        the process group and the collectives the model calls (all-reduce, gather)
shm_collectives.py  those collectives through shared memory, for CPU ranks of one host
layers.py       row-parallel Linear, vocabulary-parallel embedding, the logits' gather
loading.py      the checkpoint slices a rank reads (safetensors, GGUF, random weights)
launch.py       rank 0: spawn the followers, join the group, watch them, stop them
follower.py     ranks 1..tp-1: load their shard, then run every forward rank 0 sends
step_message.py one forward's inputs (and the request-row writes before it) for a follower
"""
