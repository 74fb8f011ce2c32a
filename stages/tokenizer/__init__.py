"""The tokenizer stage: prompts and chats into token ids.

stage.py           each job read by the request normaliser (jobs/request_normaliser.py):
                   tokenized, refused beyond the context, passed on to the router
                   (the tokenizer itself, shared with the engine: jobs/model_tokenizer.py)
hf_tokenizer.py    that tokenizer's names as the stage gave them (StageTokenizer,
                   load_stage_tokenizer), for code that imports them from here
"""
