"""From logits to tokens, per request.

sampler.py     batched sampling with per-request settings
penalties.py   logit edits from a request's settings and history
logit_bias.py  a request's logit_bias as tensors, built once
grammar.py     grammar-constrained decoding: llguidance matchers and their masks
logprobs.py    log-probabilities reported back to the client
"""
