"""Inference servers for regeneration: launching llama-server and SGLang as watched child processes, the HTTP
request formats with retries, a pool of servers, and in-process batched generation with transformers."""
