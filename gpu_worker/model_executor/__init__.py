"""Running the model: one forward per step.

model_runner.py    `ModelRunner`: the model, the KV memory and the attention backend
forward_batch.py   the per-batch data of one forward: token ids, positions, KV locations
forward_mode.py    what kind of step a forward is (no torch: the metrics name it too)
forward_context.py  the runtime objects a forward needs, published for its duration
graph_runner.py    decode through CUDA graphs
self_check.py      a fast attention path checked against the plain one before it serves
weight_swap.py     new weights loaded and checked beside the serving ones, then copied in
hooks.py           forward hooks configured by name
cpu_malloc.py      freed memory kept in glibc's heap on CPU
"""
