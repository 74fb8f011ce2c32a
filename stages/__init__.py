"""The CPU stages, one package each; no torch, and nothing from gpu_worker/.

ingress/      the aiohttp HTTP API (OpenAI's and a native /generate), batches, tenancy
tokenizer/    prompts and chats into token ids, refused beyond the context
router/       each job to a live worker, by the prefix its cache holds against its load
              (least-loaded with the `load` policy); a dead worker's jobs back
detokenizer/  each step's tokens into text deltas on the requesters' reply streams
"""
