"""STAND-IN for sglang 0.5.14, for tests only: the few names eagle3_core/features/sglang_runner.py calls, at the
same module paths, with the same signatures, running a transformers model on CPU or GPU without SGLang's kernels.

It exists because SGLang cannot run where the tests run (its kernels need CUDA and its pinned torch). A test puts
tests/sglang_standin on the PYTHONPATH of the processes that should import it (never on the test session's own path
for good). What it mirrors, name by name, is checked against the pinned release's wheel by
tests/test_sglang_backend.py (`test_every_name_the_stand_in_mirrors_exists_in_the_pinned_wheel`): every public
module, class, function, method, parameter and attribute defined here exists there. Names starting with `_` are
the stand-in's own (how it runs the transformers model) and mirror nothing.

Behaviour mirrored (each at its upstream file): ragged extend batches (samples back to back), the model files'
capture of layer *inputs* in `layers_to_capture` and their `set_eagle3_layers_to_capture` rules (models/llama.py:
+1; models/deepseek_v2.py: +1 only when the first id is 1), the final-normed hidden states handed to the logits
processor with the captured list, and a vocab-parallel lm_head whose rank holds a padded slice
(layers/vocab_parallel_embedding.py, padding to 64). The decoder itself runs whole on every rank.
"""
