"""The detokenizer stage (stage.py), the incremental decoding it runs per request
(incremental.py), and when each reply stream's expiry is due (stream_expiries.py)."""
