"""The engine's tokenizer as the request normaliser's `PromptTokenizer`.

The engine reads prompts with the normaliser the pipeline uses (jobs/request_normaliser.py);
this only adapts transformers' tokenizer, which the engine loads with the model, to it. A
chat is checked and its tools placed by jobs/chat_messages.py, as in the stages' tokenizer,
so both render the same text (tests/test_stage_tokenizer.py).
"""

from __future__ import annotations

from typing import Any

from jobs.chat_messages import template_error, template_input


class EngineTokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.hf_tokenizer.encode(text) for text in texts]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        template = getattr(self.hf_tokenizer, "chat_template", None) or None
        chat, extra = template_input(template, messages, tools)
        try:
            text = self.hf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as exc:  # the model's template, fed by the caller
            raise template_error(exc) from exc
        # The template already wrote any special tokens the model expects.
        return self.hf_tokenizer.encode(text, add_special_tokens=False)
