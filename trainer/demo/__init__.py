"""Demo assets shipped with the trainer: a small instruction data set, its preference pairs and
multi-turn conversations, and a matching tokenizer (with a chat template)."""

from pathlib import Path

from finetune_contract import fields

DEMO_DIR = Path(__file__).resolve().parent
# The contract names them relative to the trainer's working directory (the repository's root,
# /app in the image), where the Airflow side finds them too.
_ROOT = DEMO_DIR.parents[1]
DEMO_DATASET = _ROOT / fields.DEMO_DATASET
DEMO_PREFERENCES = _ROOT / fields.DEMO_PREFERENCES  # method dpo's demo data set
DEMO_CONVERSATIONS = DEMO_DIR / "conversations.jsonl"  # multi-turn, for a demo mixture
DEMO_TOKENIZER = _ROOT / fields.DEMO_TOKENIZER
# lm-evaluation-harness tasks shipped with the trainer (trainer/evaluate.py's include_path).
EVAL_TASKS_DIR = DEMO_DIR.parent / "eval_tasks"
DEMO_EVAL_TASK_DATA = EVAL_TASKS_DIR / "demo_instructions.jsonl"
