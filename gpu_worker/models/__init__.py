"""Llama-family models, their configs, and loading (HF folders, GGUF files, random shapes)."""
