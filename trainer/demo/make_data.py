"""Write the demo instruction data set: synthetic tasks a tiny model learns in minutes.

python -m trainer.demo.make_data [--rows 3000] [--seed 0] [--out FILE]
python -m trainer.demo.make_data --eval-task   # the demo's multiple-choice benchmark task
python -m trainer.demo.make_data --preferences # the DPO demo's (prompt, chosen, rejected) rows
python -m trainer.demo.make_data --conversations # multi-turn conversations, some calling a tool
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

from trainer.demo import DEMO_CONVERSATIONS, DEMO_DATASET, DEMO_EVAL_TASK_DATA, DEMO_PREFERENCES

WORDS = (
    "apple bird boat book cake car cat cloud corn cup desk dog door drum egg fish flag fox frog "
    "glass goat hat hill horse house ice jam key kite lamp leaf lion map milk moon mouse nest "
    "owl pen pig rain ring road rock rose salt sand ship shoe snow sock star stone sun tent tree "
    "wall wind wolf"
).split()
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip

Example = tuple[str, str]


def reverse_words(rng: random.Random) -> Example:
    words = rng.sample(WORDS, 3)
    return f"Reverse the list: {' '.join(words)}", " ".join(reversed(words))


def uppercase_word(rng: random.Random) -> Example:
    word = rng.choice(WORDS)
    return f"Write in capitals: {word}", word.upper()


def add_numbers(rng: random.Random) -> Example:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} plus {b}?", str(a + b)


def next_weekday(rng: random.Random) -> Example:
    i = rng.randrange(len(WEEKDAYS))
    return f"Which day comes after {WEEKDAYS[i]}?", WEEKDAYS[(i + 1) % len(WEEKDAYS)]


def next_month(rng: random.Random) -> Example:
    i = rng.randrange(len(MONTHS))
    return f"Which month comes after {MONTHS[i]}?", MONTHS[(i + 1) % len(MONTHS)]


def repeat_word(rng: random.Random) -> Example:
    word, n = rng.choice(WORDS), rng.randint(2, 4)
    return f"Repeat {word} {n} times.", " ".join([word] * n)


def sort_numbers(rng: random.Random) -> Example:
    numbers = rng.sample(range(10), 3)
    return f"Sort ascending: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))


TASKS: tuple[Callable[[random.Random], Example], ...] = (
    reverse_words, uppercase_word, add_numbers, next_weekday, next_month, repeat_word, sort_numbers,
)  # fmt: skip


def make_rows(rows: int, seed: int) -> list[dict[str, str]]:
    """Return `rows` examples, cycling through the tasks so each is equally represented."""
    rng = random.Random(seed)
    examples = []
    for i in range(rows):
        prompt, response = TASKS[i % len(TASKS)](rng)
        examples.append({"prompt": prompt, "response": response})
    rng.shuffle(examples)
    return examples


def make_choice_rows(rows: int, seed: int, choices: int = 4) -> list[dict]:
    """Multiple-choice items of the same tasks for the benchmark task (trainer/eval_tasks): the
    answer among `choices` answers to other draws of the same task."""
    rng = random.Random(seed)
    items = []
    for i in range(rows):
        task = TASKS[i % len(TASKS)]
        prompt, answer = task(rng)
        options = {answer}
        while len(options) < choices:
            options.add(task(rng)[1])
        shuffled = sorted(options)
        rng.shuffle(shuffled)
        items.append({"prompt": prompt, "choices": shuffled, "label": shuffled.index(answer)})
    return items


def make_preference_rows(rows: int, seed: int) -> list[dict[str, str]]:
    """Preference pairs of the same tasks: chosen is the right answer, rejected the right answer
    to a question of another task (a number to "Which month comes after July?", a month to
    "Write in capitals: owl"). The rule every rejected answer breaks is answering the question
    asked, which the prompt's first words tell: a tiny model learns it within the demo's steps.
    A wrong answer of the right kind (another month) would ask it to know the tasks first."""
    rng = random.Random(seed)
    pairs = []
    for i in range(rows):
        task = TASKS[i % len(TASKS)]
        prompt, answer = task(rng)
        other = TASKS[(i + rng.randrange(1, len(TASKS))) % len(TASKS)]
        pairs.append({"prompt": prompt, "chosen": answer, "rejected": other(rng)[1]})
    rng.shuffle(pairs)
    return pairs


SYSTEM_PROMPT = "Be brief."


def make_conversation_rows(rows: int, seed: int) -> list[dict]:
    """Conversations in OpenAI's shape ({"messages": [{"role", "content"}, ...]}) of the same
    tasks: two or three questions, each answered by the assistant, a quarter of them after a
    system prompt; every fifth instead asks a sum, which the assistant leaves to a calculator tool
    (its tool call, the tool's result, then its answer), as tool-calling data sets do.
    Each fits the demo's seq_len (128 tokens) with the demo tokenizer's chat template."""
    rng = random.Random(seed)
    conversations = []
    for i in range(rows):
        messages: list[dict] = []
        if i % 4 == 0:
            messages.append({"role": "system", "content": SYSTEM_PROMPT})
        questions = 2 + i % 2
        if i % 5 == 0:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            call = {"type": "function", "function": {
                "name": "add", "arguments": json.dumps({"a": a, "b": b})}}
            messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "content": str(a + b)},
                         {"role": "assistant", "content": str(a + b)}]
            questions = 0
        for turn in range(questions):
            prompt, response = TASKS[(i + turn) % len(TASKS)](rng)
            messages += [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": response}]
        conversations.append({"messages": messages})
    rng.shuffle(conversations)
    return conversations


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--eval-task", action="store_true",
                        help="write the benchmark task's items (42 rows, seed 1) instead")
    parser.add_argument("--preferences", action="store_true",
                        help="write the DPO demo's preference pairs (1000 rows, seed 2) instead")
    parser.add_argument("--conversations", action="store_true",
                        help="write the demo's multi-turn conversations (1000 rows, seed 3) "
                        "instead")
    args = parser.parse_args(argv)
    if args.conversations:
        write_jsonl(args.out or DEMO_CONVERSATIONS, make_conversation_rows(1000, 3),
                    "conversations")
    elif args.preferences:
        write_jsonl(args.out or DEMO_PREFERENCES, make_preference_rows(1000, 2), "pairs")
    elif args.eval_task:
        write_jsonl(args.out or DEMO_EVAL_TASK_DATA, make_choice_rows(42, 1), "items")
    else:
        write_jsonl(args.out or DEMO_DATASET, make_rows(args.rows, args.seed), "rows")


def write_jsonl(out: Path, rows: list[dict], what: str) -> None:
    Path(out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} {what} to {out}")


if __name__ == "__main__":
    main()
