"""Llama-family model, weight loaders, tokenizer and the registry of model names."""
