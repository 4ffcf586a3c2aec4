"""Token lengths of the GSM8K training set (tests/data/gsm8k/train.jsonl) as chat conversations (question, answer)
under a target's chat template: the real length distribution of benchmarks/train_throughput.py --mode real.

    python benchmarks/data/make_gsm8k_lengths.py TOKENIZER_DIR NAME > benchmarks/data/gsm8k_lengths.json

(gsm8k_lengths.json: the embedded target's tokenizer, NAME SmolLM2-135M-Instruct.)
"""
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = [json.loads(line) for line in (ROOT / "tests/data/gsm8k/train.jsonl").open()]
texts = [tok.apply_chat_template([{"role": "user", "content": r["question"]},
                                  {"role": "assistant", "content": r["answer"]}], tokenize=False) for r in rows]
lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
json.dump({"source": f"tests/data/gsm8k/train.jsonl: question + answer under {sys.argv[2]}'s chat template",
           "lengths": lengths}, sys.stdout)
