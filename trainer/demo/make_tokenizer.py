"""Train the demo byte-level BPE tokenizer on the demo data set and save it for AutoTokenizer, with
its chat template (conversations, multi-turn and with tool calls, render with it).

python -m trainer.demo.make_tokenizer [--data FILE] [--vocab 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from trainer.demo import DEMO_DATASET, DEMO_TOKENIZER

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
# The prompt template lives in trainer.data; it is repeated here only as training text.
TEMPLATE_TEXT = "### Instruction:\n\n\n### Response:\n"
# The demo's chat template: each message as <|role|>, a line break and its content (an
# assistant's tool calls as <call>name {"argument": ...}</call>), the assistant's turn
# ended by </s>; the tools a row offers first. No generation marks: the prepare_data stage cuts
# the assistant's turns from renderings up to each (finetune_contract.data.chat_turns).
# (Hugging Face renders templates with trim_blocks: a line break after a block tag is dropped.)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>\n{{ tools | tojson }}\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "<call>{{ call['name'] }} {{ call['arguments'] | tojson }}</call>"
    "{% endfor %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_texts(data: Path) -> Iterator[str]:
    with open(data) as f:
        for line in f:
            row = json.loads(line)
            yield TEMPLATE_TEXT + row["prompt"]
            yield row["response"]


def train_tokenizer(data: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(data), trainer=trainer)
    # Llama-style: every encoded text starts with <s>; </s> is appended by the data pipeline.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEMO_DATASET)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=DEMO_TOKENIZER)
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer(args.data, args.vocab)
    tokenizer.save_pretrained(args.out)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
