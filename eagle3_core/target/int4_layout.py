"""The packed INT4 layout of compressed-tensors' pack-quantized format, as the published Kimi-K2.5 checkpoint stores
its routed experts (config.json quantization_config: num_bits 4, symmetric, strategy group, group_size 32):
int32 words, input j in nibble j % 8 of word j // 8 (stored as q + 8), one scale per GROUP inputs."""
from __future__ import annotations

GROUP = 32          # inputs per scale (the published checkpoint's group_size)
NIBBLES = 8         # INT4 values per int32 word
