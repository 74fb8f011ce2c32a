"""OpenAI's Batch API storage in Redis, shared by the ingress, the `streamserve batch`
command and `Client`. No torch.

files.py           `FileStore`: /v1/files, a batch's input, output and error files
batches.py         `BatchStore`: batches, their statuses, each line's result written once
input_file.py      a batch's input file read into its lines, the bad ones into line errors
metadata.py        OpenAI's bounds of a batch's or a response's metadata
client_methods.py  `Client`'s batch methods over the two stores
"""
