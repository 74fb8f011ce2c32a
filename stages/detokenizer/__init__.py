"""The detokenizer stage (stage.py) and the incremental decoding it runs per request
(incremental.py)."""
