"""The tokenizer stage (stage.py) and the tokenizer it loads from a model's files
(hf_tokenizer.py)."""
