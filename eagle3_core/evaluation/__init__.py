"""Measuring a draft: greedy and speculative decoding (chain, tree), tau with bootstrap intervals, the replay
evaluator, the speed-up model, pre-flight checks, plots, and the llama.cpp and SGLang deployment benchmarks."""
