"""Inference servers: launching llama.cpp's llama-server and an async OpenAI-compatible client."""
