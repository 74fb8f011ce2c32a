"""What a deployment runs on besides the bus: the embedded Redis-protocol server, child
processes, and the model's files. No torch.

embedded_server.py  the private server `streamserve up` starts (unix socket, append-only file)
child_process.py    children that stop in their parent's order
model_files.py      a `--model` argument resolved to its files (worker and tokenizer alike)
"""
