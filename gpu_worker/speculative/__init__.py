"""Speculative decoding: drafts proposed cheaply, verified in one forward of the model.

drafter.py      which requests draft how many tokens this step
ngram.py        n-gram (prompt lookup) drafting
draft_model.py  draft-model drafting
draft_state.py  a request's speculative-decoding state
verify.py       which tokens a verify step emits, given the target's logits
"""
