"""The target model: loading (HF directory, hub name or GGUF) and aux capture (loading), its family, aux ids and rope
read one way (family), and its parameter bytes per GPU under a parallel plan (memory)."""
