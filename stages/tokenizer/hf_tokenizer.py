"""The tokenizer stage's names for the model's tokenizer, for code that imports them from
here: the tokenizer itself is jobs/model_tokenizer.py, which the engine shares."""

from jobs.model_tokenizer import ModelTokenizer as StageTokenizer
from jobs.model_tokenizer import cached_tokenizer_folder, gguf_tokenizer_folder
from jobs.model_tokenizer import load_model_tokenizer as load_stage_tokenizer

__all__ = ["StageTokenizer", "cached_tokenizer_folder", "gguf_tokenizer_folder",
           "load_stage_tokenizer"]  # fmt: skip
