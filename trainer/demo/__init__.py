"""Demo assets shipped with the trainer: a small instruction data set, its preference pairs and
multi-turn conversations, and a matching tokenizer (with a chat template)."""

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
DEMO_DATASET = DEMO_DIR / "instructions.jsonl"
DEMO_PREFERENCES = DEMO_DIR / "preferences.jsonl"  # method dpo's demo data set
DEMO_CONVERSATIONS = DEMO_DIR / "conversations.jsonl"  # multi-turn, for a demo mixture
DEMO_TOKENIZER = DEMO_DIR / "tokenizer"
# lm-evaluation-harness tasks shipped with the trainer (trainer/evaluate.py's include_path).
EVAL_TASKS_DIR = DEMO_DIR.parent / "eval_tasks"
DEMO_EVAL_TASK_DATA = EVAL_TASKS_DIR / "demo_instructions.jsonl"
