"""Llama-family models, their configs, and loading (HF folders, GGUF files, random shapes).

llama.py           the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2)
layers.py          Linear and RMSNorm with a CPU-kernel path
fused_layers.py    every decoder layer in one C call on CPU (gemm_bf16 or gemm_f32, no hooks)
rotary.py          rotary position embeddings
config.py          `ModelConfig`, parsed from a HF config.json
loader.py          the model a model argument names, built and loaded
gguf_convert.py    a GGUF file converted into a cached Hugging Face folder
random_shapes.py   known shapes for `random:<name>`, filled with deterministic random weights
"""
