"""The tokenizer stage: prompts and chats into token ids.

stage.py           each job read by the request normaliser (jobs/request_normaliser.py):
                   tokenized, refused beyond the context, passed on to the router
hf_tokenizer.py    a model's tokenizer files read without torch (tokenizers + jinja2)
"""
