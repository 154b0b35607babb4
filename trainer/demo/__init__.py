"""Demo assets shipped with the trainer: a small instruction data set and a matching tokenizer."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_DATASET = DEMO_DIR / "instructions.jsonl"
DEMO_TOKENIZER = DEMO_DIR / "tokenizer"
