"""Tokenizers with the chat templates of four families, made by the tests (no hub): the demo
tokenizer's own template, one in the style of Qwen2.5's (ChatML, a default system prompt, tools in
the system turn, tool results as user turns, and {% generation %} marks around what the assistant
says), one in the style of Llama 3.1's (header tokens, the system turn first, tool results as
ipython turns, no generation marks) and one in the style of Qwen3's (ChatML without generation
marks, whose assistant turns after the last user query carry a reasoning block, empty when the
message has no reasoning, and earlier turns none: a turn renders otherwise once another follows).
Each is the demo tokenizer with its family's special tokens added and the template set;
`make_chat_tokenizer` writes one into a directory AutoTokenizer loads.
"""

from __future__ import annotations

from pathlib import Path

# ChatML as Qwen2.5 writes it, written here anew: {%- and -%} trim what the layout adds.
QWEN_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_TOKENS = ["<|im_start|>", "<|im_end|>"]

# Llama 3.1's layout, written here anew: a system turn when there is a system prompt or tools,
# each turn a header and its content trimmed, ended by <|eot_id|>; tool calls as JSON.
LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- if system or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls is defined %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '{\"name\": \"' + call.name + '\", \"parameters\": ' + call.arguments | tojson + '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen3's behaviour, written here anew: the last user query (a user turn that is not tool
# results) found from the end; an assistant turn after it is rendered with its reasoning in
# <think>...</think> (empty without any) when it is the last message or has reasoning, any
# other without; reasoning is the message's reasoning_content, or what its content holds before
# </think>; tool calls after the content; consecutive tool results in one user turn.
QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query=messages | length - 1, found=false) %}"
    "{%- for message in messages[::-1] %}"
    "{%- if not ns.found and message.role == 'user' and not message.content.startswith("
    "'<tool_response>') %}"
    "{%- set ns.found = true %}{%- set ns.last_query = messages | length - 1 - loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string "
    "else '' %}"
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{{- content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# <think> and </think> are added tokens that are not special, as Qwen3's are: a decode keeps them.
QWEN3_WORDS = ["<think>", "</think>"]

FAMILIES = {"qwen": (QWEN_STYLE, QWEN_TOKENS), "llama3": (LLAMA3_STYLE, LLAMA3_TOKENS),
            "qwen3": (QWEN3_STYLE, QWEN_TOKENS)}



def make_chat_tokenizer(out: Path, family: str) -> Path:
    """The demo tokenizer with `family`'s special tokens and chat template (or, for "demo", its
    own template), saved to `out`; returns `out`."""
    from transformers import AutoTokenizer

    from trainer.demo import DEMO_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    if family != "demo":
        template, tokens = FAMILIES[family]
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
        if family == "qwen3":
            tokenizer.add_tokens(QWEN3_WORDS)
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return out


def without_chat_template(out: Path) -> Path:
    """The demo tokenizer without its chat template, saved to `out`."""
    from transformers import AutoTokenizer

    from trainer.demo import DEMO_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    for leftover in out.glob("chat_template.*"):
        leftover.unlink()
    return out
