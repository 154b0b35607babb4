"""What a data set and a tokenizer must be, from their files, and how one example is encoded: a
plain text, a prompt and its response (an instruction template or the tokenizer's chat template),
or a conversation of many turns rendered with the chat template, the loss on every assistant turn
and nowhere else.

The prepare_data stage encodes every row with these functions (finetune_data.prepared_set);
`validate` reads the same files with these functions alone (no torch, no `datasets`), so a typo in
a field name, a directory without data files or a tokenizer without a chat template is named
before anything starts.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune_contract.fields import hub_id_problem, quoted
from finetune_contract.train_config import TrainConfig

# A data file's format from its extension; jsonl and json are both read by `datasets`' json.
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
IGNORE_INDEX = -100  # labels that carry no loss (the prompt, padding)
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
# Why a row is skipped; summary.json's skipped_rows_by_reason keys. template_error: the chat
# template cannot render the row's conversation (or not so that its turns can be told apart).
MALFORMED, MISSING, NOT_STRING, EMPTY, TOO_LONG, TEMPLATE = (
    "malformed", "missing_field", "not_string", "empty", "too_long", "template_error")
ROW_PROBLEMS = (MALFORMED, MISSING, NOT_STRING, EMPTY, TOO_LONG, TEMPLATE)
# The columns a conversation is found in when messages_field is empty: OpenAI's, ShareGPT's.
CONVERSATION_COLUMNS = ("messages", "conversations")
# A conversation row's tool schemas (OpenAI's fine-tuning format), handed to the chat template.
TOOLS_COLUMN = "tools"
# The roles a message may have (OpenAI's `role`, ShareGPT's `from`) -> the chat templates' roles.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user",
              "assistant": "assistant", "gpt": "assistant", "model": "assistant",
              "function_call": "assistant", "tool": "tool", "function": "tool",
              "observation": "tool", "function_response": "tool", "ipython": "tool"}
# Hugging Face's marks around what the assistant generates in a chat template.
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Files one of which a tokenizer directory needs (fast tokenizers, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def dataset_source(dataset: str) -> str:
    """Where a data set lives: "s3" (an s3:// URI), "local" (a file or directory) or "hub".

    A name that is not on disk is a hub name only if shaped like one and not like a data file, so
    a mistyped path is reported missing rather than looked up on the hub.
    """
    if dataset.startswith("s3://"):
        return "s3"
    path = Path(dataset).expanduser()
    try:
        exists = path.exists()
    except OSError:  # a name too long to look up is no file here
        exists = False
    if exists or path.suffix.lower() in FORMAT_BY_SUFFIX or hub_id_problem(dataset) is not None \
            or dataset.startswith((".", "/", "~", "_")):
        return "local"
    return "hub"


def file_format(path: str, dataset_format: str) -> str:
    """jsonl, json, parquet or csv: the configured format, or the one the extension says."""
    if dataset_format != "auto":
        return dataset_format
    suffix = Path(path).suffix.lower()
    if suffix not in FORMAT_BY_SUFFIX:
        raise ValueError(
            f"dataset_format is auto but the extension of {quoted(path)} is not one of "
            f"{', '.join(FORMAT_BY_SUFFIX)}; set dataset_format"
        )
    return FORMAT_BY_SUFFIX[suffix]


def builder_name(path: str, dataset_format: str) -> str:
    """The `datasets` builder that reads a file of this format."""
    fmt = file_format(path, dataset_format)
    return "json" if fmt == "jsonl" else fmt


def data_files(path: Path, dataset_format: str) -> list[str]:
    """The file itself, or a directory's data files (recursively, in path order), all one format.

    A directory's data files are those with a data extension (of dataset_format, when set); hidden
    and `_` files, as Spark and S3 tools leave them, are skipped.
    """
    if not path.exists():
        raise ValueError(f"dataset {str(path)!r} does not exist")
    if path.is_file():
        return [str(path)]
    files = [
        p for p in sorted(path.rglob("*"))
        if p.is_file() and p.suffix.lower() in FORMAT_BY_SUFFIX
        and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
    ]
    if dataset_format != "auto":
        wanted = builder_name(str(path), dataset_format)
        files = [p for p in files if builder_name(str(p), "auto") == wanted]
    if not files:
        raise ValueError(f"dataset directory {str(path)!r} holds no data files "
                         f"({', '.join(FORMAT_BY_SUFFIX)})")
    formats = sorted({builder_name(str(p), "auto") for p in files})
    if len(formats) > 1:
        raise ValueError(
            f"dataset directory {str(path)!r} holds files of formats {', '.join(formats)}; keep "
            "one format there or choose one with dataset_format"
        )
    return [str(p) for p in files]


def row_columns(cfg: TrainConfig) -> dict[str, str]:
    """The option that names each column the rows need -> the column."""
    if cfg.method == "dpo":
        return {"prompt_field": cfg.prompt_field, "chosen_field": cfg.chosen_field,
                "rejected_field": cfg.rejected_field}
    if cfg.text_field:
        return {"text_field": cfg.text_field}
    if cfg.messages_field:
        return {"messages_field": cfg.messages_field}
    return {"prompt_field": cfg.prompt_field, "response_field": cfg.response_field}


def row_format(cfg: TrainConfig, columns: list[str]) -> TrainConfig:
    """The config a data set of these columns is read with: messages_field set to the column of
    its conversations when it holds them (messages_field empty: a messages or conversations
    column, when the rows lack the prompt or the response field; DPO and plain text never)."""
    if cfg.method == "dpo" or cfg.text_field or cfg.messages_field or \
            (cfg.prompt_field in columns and cfg.response_field in columns):
        return cfg
    found = next((column for column in CONVERSATION_COLUMNS if column in columns), None)
    return dataclasses.replace(cfg, messages_field=found) if found else cfg


def row_kind(cfg: TrainConfig) -> str:
    """What a row of this (row_format's) config is: text, prompt and response, conversation,
    or preference pair."""
    if cfg.method == "dpo":
        return "preference pairs"
    if cfg.text_field:
        return "text"
    return "conversations" if cfg.messages_field else "prompt and response"


def other_method_problem(cfg: TrainConfig, columns: list[str]) -> str | None:
    """A data set of the other method's rows (preference pairs in an sft run, prompts and
    responses or conversations in a dpo run), for a mixture, whose sources are all of the run's
    method; None when its columns are not those of the other method."""
    pairs = cfg.chosen_field in columns and cfg.rejected_field in columns
    if cfg.method == "dpo":
        sft = [column for column in (cfg.response_field, cfg.text_field, *CONVERSATION_COLUMNS)
               if column and column in columns]
        if pairs or not sft:
            return None
        return (f"holds SFT rows (column {quoted(sft[0])}), not preference pairs (chosen_field="
                f"{quoted(cfg.chosen_field)}, rejected_field={quoted(cfg.rejected_field)}): a "
                "dpo mixture is of preference pairs only")
    if not pairs or row_format(cfg, columns).messages_field or cfg.text_field or \
            cfg.response_field in columns:
        return None
    return (f"holds preference pairs (columns {quoted(cfg.chosen_field)}, "
            f"{quoted(cfg.rejected_field)}), not SFT rows: a mixture is of SFT sources (method "
            "sft) or of preference pairs (method dpo), not both")


def field_problem(columns: dict[str, str], row: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, what is wrong) for a row whose fields cannot be trained on, else None. A
    conversation's column holds a list (or its JSON text); its messages are checked when it is
    encoded (`conversation`)."""
    for option, column in columns.items():
        value = row.get(column)
        if value is None:
            return MISSING, f"{option}={quoted(column)} is missing or null"
        if option == "messages_field" and isinstance(value, list):
            if not value:
                return EMPTY, f"{option}={quoted(column)} is an empty list"
            continue
        if not isinstance(value, str):
            what = "a list of messages or a string" if option == "messages_field" else "a string"
            return NOT_STRING, (f"{option}={quoted(column)} is a {type(value).__name__}, not "
                                f"{what}")
        if not value.strip():
            return EMPTY, f"{option}={quoted(column)} is empty"
    return None


def missing_columns(cfg: TrainConfig, columns: list[str], where: str) -> list[tuple[str, str]]:
    """A (field, message) for each column the config names that the data does not have."""
    return [(option, f"{option}={quoted(column)} is not a column of {where} (columns: "
             f"{', '.join(columns) or 'none'})")
            for option, column in row_columns(cfg).items() if column not in columns]


# Where a reasoning model's thinking ends in an assistant's message (Qwen3, DeepSeek-R1, QwQ).
REASONING_END = "</think>"


class TurnsNotCut(ValueError):
    """A chat template renders a conversation's first turns differently inside the whole, so
    where an assistant's turn starts and ends in the rendered text cannot be told."""


def chat_turns(tokenizer: Any, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> list[tuple[str, bool]]:
    """The chat template's rendering of a conversation cut into spans, in order, each with
    whether it is an assistant's turn (labelled): what the template adds for an assistant's
    message after its generation prompt (the content, a tool call, its end-of-turn marker).

    Cut from renderings of the conversation up to each turn, where each starts with the one
    before. A template that renders a turn differently once more follows it (Qwen3's drops an
    earlier turn's reasoning block: `<think>...</think>`, empty or not) is cut from its rendering
    of the whole conversation instead (`_turns_in_whole`). TurnsNotCut when neither can tell
    where a turn starts and ends. The first message is not the assistant's (nothing would
    prompt it)."""
    @functools.cache  # the whole's cut renders again what the first pass had rendered
    def render(count: int, cue: bool) -> str:
        return tokenizer.apply_chat_template(messages[:count], tools=tools, tokenize=False,
                                             add_generation_prompt=cue)

    spans: list[tuple[str, bool]] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        cue, turn = render(index, True), render(index + 1, False)
        if not turn.startswith(cue):
            raise TurnsNotCut(
                f"the chat template renders the conversation up to message {index + 1} "
                "differently with and without add_generation_prompt (the second does not start "
                "with the first), so the assistant's turn cannot be cut from it")
        if not cue.startswith(done):  # a turn rendered otherwise once more follows it
            return _turns_in_whole(render, messages)
        spans += [(cue[len(done):], False), (turn[len(cue):], True)]
        done = turn
    if messages[-1]["role"] != "assistant":
        whole = render(len(messages), False)
        if not whole.startswith(done):
            return _turns_in_whole(render, messages)
        spans.append((whole[len(done):], False))
    return spans


def _turns_in_whole(render: Callable[[int, bool], str], messages: list[dict[str, Any]]
                    ) -> list[tuple[str, bool]]:
    """chat_turns for a template that renders a turn otherwise once another follows it: the
    spans of its rendering of the whole conversation, which is what the model reads of those
    turns when the conversation goes on. An assistant turn starts where the rendering up to it
    with the generation prompt ends (which the whole must start with) and runs as far as the
    whole goes on as that turn's rendering as the last message ends: Qwen3's drops the
    reasoning block before an earlier turn's content, and the rest (the content, a tool call,
    the end-of-turn marker) is the same."""
    whole = render(len(messages), False)
    spans: list[tuple[str, bool]] = []
    done = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        cue = render(index, True)
        alone = render(index + 1, False)[len(cue):]
        if not whole.startswith(cue) or len(cue) < done:
            raise TurnsNotCut(
                f"the chat template renders the conversation up to message {index + 1} (with "
                "add_generation_prompt) differently from its start within the whole, so the "
                "assistant's turn cannot be cut from it")
        start = len(cue)
        # The longest stretch of the whole from the turn's start that ends as the turn alone.
        length = next((k for k in range(min(len(alone), len(whole) - start), 0, -1)
                       if alone.endswith(whole[start:start + k])), 0)
        if not length:
            raise TurnsNotCut(
                f"the chat template renders message {index + 1}, an assistant turn, within the "
                "whole conversation as no ending of how it renders it as the last message, so "
                "where the turn ends cannot be told")
        spans += [(whole[done:start], False), (whole[start:start + length], True)]
        done = start + length
    if done < len(whole):
        spans.append((whole[done:], False))
    return spans


def chat_texts(tokenizer: Any, prompt: str, response: str) -> tuple[str, str]:
    """The chat template's rendering of the user's turn with the assistant's cue, and of both."""
    try:
        (prompt_text, _), (reply, _) = chat_turns(
            tokenizer, [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": response}])
    except TurnsNotCut:
        raise ValueError(
            f"prompt_template=chat: the chat template of tokenizer {tokenizer.name_or_path} "
            "renders a conversation that does not start with its prompt (rendered with "
            "add_generation_prompt=True), so the prompt cannot be masked from the loss"
        ) from None
    return prompt_text, prompt_text + reply


def has_generation_marks(tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> bool:
    """Whether the tokenizer's chat template marks what the assistant generates
    ({% generation %} ... {% endgeneration %})."""
    return bool(GENERATION_MARK.search(tokenizer.get_chat_template(None, tools)))


def conversation(value: Any, tools: Any = None
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None,
                            tuple[str, str] | None]:
    """(messages, tools, problem): a row's conversation (a list of messages or its JSON text) as
    chat templates take it. OpenAI's {role, content} and ShareGPT's {from, value} give
    {"role", "content"}; ShareGPT's speakers become roles (human: user, gpt: assistant,
    function_call: assistant, observation: tool); a content of text parts is their text; other
    keys (tool_calls, name, tool_call_id) are kept, without nulls (as Arrow fills a struct's
    missing keys); a tool call's JSON-text arguments become an object, as templates expect."""
    def bad(reason: str, what: str) -> tuple[list, None, tuple[str, str]]:
        return [], None, (reason, what)

    try:
        value = json.loads(value) if isinstance(value, str) else value
        tools = json.loads(tools) if isinstance(tools, str) else tools
    except ValueError as error:
        return bad(MALFORMED, f"not JSON ({error})")
    if not isinstance(value, list):
        return bad(MALFORMED, f"a JSON {type(value).__name__}, not a list of messages")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(tool, dict) for tool in tools)):
        return bad(MALFORMED, f"{TOOLS_COLUMN} is not a list of tool schemas")
    messages = []
    for number, message in enumerate(value, 1):
        if not isinstance(message, dict):
            return bad(MALFORMED, f"message {number} is a {type(message).__name__}, not an "
                       "object")
        speaker = message.get("role", message.get("from"))
        role = CHAT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            return bad(MALFORMED, f"message {number} has role {quoted(speaker)}; known: "
                       + ", ".join(CHAT_ROLES))
        content = _text(message.get("content", message.get("value")))
        if content is None:
            return bad(NOT_STRING, f"message {number}'s content is not text")
        kept = {key: item for key, item in message.items()
                if item is not None and key not in ("role", "from", "content", "value")}
        if kept.get("tool_calls"):
            kept["tool_calls"] = [_tool_call(call) for call in kept["tool_calls"]]
        else:
            kept.pop("tool_calls", None)
        if not content.strip() and not (role == "assistant" and kept.get("tool_calls")):
            return bad(EMPTY, f"message {number} ({role}) is empty")
        messages.append({"role": role, "content": content, **kept})
    if not messages:
        return bad(EMPTY, "the conversation has no messages")
    if messages[0]["role"] == "assistant":
        return bad(MALFORMED, "message 1 is the assistant's: nothing prompts it")
    if not any(message["role"] == "assistant" for message in messages):
        return bad(EMPTY, "no assistant turn to learn")
    return messages, tools or None, None


def _text(content: Any) -> str | None:
    """A message's text: a string, or the text of OpenAI's content parts; None when neither."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type", "text") == "text"]
        if all(isinstance(text, str) for text in texts):
            return "".join(texts)
    return None


def _tool_call(call: Any) -> Any:
    """A tool call without nulls, its arguments an object where they are JSON text of one."""
    if not isinstance(call, dict):
        return call
    call = {key: item for key, item in call.items() if item is not None}
    function = call.get("function")
    if isinstance(function, dict):  # OpenAI's {"type": "function", "function": {...}}
        return {**call, "function": _tool_call(function)}
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "arguments": parsed}
    return call


def encode_conversation(tokenizer: Any, cfg: TrainConfig, row: dict[str, Any]
                        ) -> tuple[tuple[str, str] | None, list[int], list[int]]:
    """(problem, input_ids, labels) of a conversation row, rendered with the tokenizer's chat
    template: the labels are the ids of every assistant turn (its content or tool call and the
    template's end-of-turn marker) and nothing else. A template with generation marks says
    where those turns are; one without has each turn cut from renderings up to it (chat_turns)
    and tokenized alone, and each labelled span must decode to the assistant's content. A row
    the template cannot render so is a bad row (template_error)."""
    messages, tools, problem = conversation(row[cfg.messages_field], row.get(TOOLS_COLUMN))
    if problem is not None:
        return problem, [], []
    try:
        if has_generation_marks(tokenizer, tools):
            input_ids, labels = _marked_turns(tokenizer, messages, tools)
        else:
            input_ids, labels, problem = _cut_turns(tokenizer, messages, tools)
    except TurnsNotCut as error:
        problem = TEMPLATE, f"{error}; a template with {{% generation %}} marks says it"
    except Exception as error:  # jinja's TemplateError (raise_exception), TypeError, ...
        problem = TEMPLATE, f"the chat template cannot render it: {type(error).__name__}: {error}"
    if problem is not None:
        return problem, [], []
    problem = _encoded_problem(input_ids, labels, cfg.seq_len)
    return (problem, [], []) if problem else (None, input_ids, labels)


def _marked_turns(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[list[int], list[int]]:
    encoded = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
    input_ids = list(encoded["input_ids"])
    labels = [token if marked else IGNORE_INDEX
              for token, marked in zip(input_ids, encoded["assistant_masks"], strict=True)]
    return input_ids, labels


def _token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids, no special token added: through a fast tokenizer's own backend where it
    has one (the same ids, without the Python wrapper's cost, which was half a conversation's
    tokenizing: 108 against 48 us for four spans, 2026-12-06), else the tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]


def _cut_turns(tokenizer: Any, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None
               ) -> tuple[list[int], list[int], tuple[str, str] | None]:
    spans = chat_turns(tokenizer, messages, tools)
    pieces = _token_ids(tokenizer, [text for text, _ in spans])
    replies = iter(message for message in messages if message["role"] == "assistant")
    input_ids: list[int] = []
    labels: list[int] = []
    for number, ((_, labelled), ids) in enumerate(zip(spans, pieces, strict=True), 1):
        input_ids += ids
        if not labelled:
            labels += [IGNORE_INDEX] * len(ids)
            continue
        labels += ids
        reply = next(replies)
        said = tokenizer.decode(ids, skip_special_tokens=True).strip()
        content = reply["content"].strip()
        # Reasoning written into the content (<think>...</think> before the reply) is the
        # template's to render: Qwen3's lays it out anew, and drops it from an earlier turn.
        answer = content.rsplit(REASONING_END, 1)[-1].strip() or content
        calls = [str((call.get("function") or call).get("name", "")) for call in
                 reply.get("tool_calls", ()) if isinstance(call, dict)]
        # A tool call is rendered as the template likes: its names and the text must be there.
        # A template may put text of its own before the content (Qwen3's reasoning block, empty
        # or the message's reasoning_content): what the assistant generates too.
        said_it = answer in said and all(name in said for name in calls) if calls else \
            said.endswith(answer)
        if not said_it:
            return [], [], (TEMPLATE, (
                f"span {number} of the rendered conversation, an assistant turn, decodes to "
                f"{quoted(said)}, not its content {quoted(content)}: the labels would not be "
                "the assistant's words; a template with {% generation %} marks says where "
                "they are"))
    return input_ids, labels, None


def encode_example(tokenizer: Any, prompt: str | None, response: str,
                   template: str = "instruction") -> tuple[list[int], list[int]]:
    """Token ids and labels for one example; with a prompt, only the response carries loss.

    Prompt and response are tokenized separately so the boundary is exact, as at inference time.
    A chat template ends the assistant's turn itself (with its own end token): no EOS is added.
    """
    eos = [tokenizer.eos_token_id]
    if prompt is None:
        input_ids = tokenizer(response)["input_ids"] + eos
        return input_ids, list(input_ids)
    if template == "chat":
        prompt_text, full_text = chat_texts(tokenizer, prompt, response)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(full_text[len(prompt_text):],
                                 add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = tokenizer(PROMPT_TEMPLATE.format(prompt=prompt))["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + eos
    return prompt_ids + response_ids, [IGNORE_INDEX] * len(prompt_ids) + response_ids


def encode_row(tokenizer: Any, cfg: TrainConfig, row: dict[str, Any]
               ) -> tuple[tuple[str, str] | None, list[int], list[int]]:
    """(problem, input_ids, labels) of one row (of a config through `row_format`): a row longer
    than seq_len is bad rather than truncated (that would cut the response and its EOS, or a
    conversation's later turns, without anyone noticing)."""
    columns = row_columns(cfg)
    problem = field_problem(columns, row)
    if problem is not None:
        return problem, [], []
    if cfg.messages_field:
        return encode_conversation(tokenizer, cfg, row)
    fields = list(columns.values())
    prompt, response = (None, row[fields[0]]) if cfg.text_field else \
        (row[fields[0]], row[fields[1]])
    input_ids, labels = encode_example(tokenizer, prompt, response, cfg.prompt_template)
    problem = _encoded_problem(input_ids, labels, cfg.seq_len)
    return (problem, [], []) if problem else (None, input_ids, labels)


def _encoded_problem(input_ids: list[int], labels: list[int], seq_len: int
                     ) -> tuple[str, str] | None:
    if len(input_ids) > seq_len:
        return TOO_LONG, f"{len(input_ids)} tokens, more than seq_len {seq_len}"
    # The first label is never predicted (nothing precedes it): it teaches nothing.
    if all(label == IGNORE_INDEX for label in labels[1:]):
        return EMPTY, "no token to learn (the response is empty once tokenized)"
    return None


Encoded = tuple[list[int], list[int]]  # (input_ids, labels)


def encode_pair(tokenizer: Any, cfg: TrainConfig, row: dict[str, Any]
                ) -> tuple[tuple[str, str] | None, Encoded, Encoded]:
    """(problem, chosen, rejected) of one DPO row: each response encoded after the prompt as an
    SFT example is, so the same rows are bad (either response too long or empty)."""
    problem = field_problem(row_columns(cfg), row)
    if problem is not None:
        return problem, ([], []), ([], [])
    encoded = []
    for option in ("chosen_field", "rejected_field"):
        ids, labels = encode_example(tokenizer, row[cfg.prompt_field], row[getattr(cfg, option)],
                                     cfg.prompt_template)
        problem = _encoded_problem(ids, labels, cfg.seq_len)
        if problem:
            return (problem[0], f"{option}: {problem[1]}"), ([], []), ([], [])
        encoded.append((ids, labels))
    return None, encoded[0], encoded[1]


def bad_row_error(cfg: TrainConfig, where: str, detail: str) -> str:
    return (f"bad row in dataset {cfg.dataset}: {where}: {detail} (bad_rows=error; "
            "bad_rows=skip skips and counts such rows)")


def split_sizes(usable_rows: int, cfg: TrainConfig) -> tuple[int, int]:
    """(train rows, eval rows): the eval split is eval_fraction of the usable rows, at least
    micro_batch; ValueError when nothing is left to train on."""
    n_eval = max(math.ceil(cfg.eval_fraction * usable_rows), cfg.micro_batch)
    if n_eval >= usable_rows:
        raise ValueError(
            f"dataset {cfg.dataset} has {usable_rows} usable rows: too few for an eval split of "
            f"{n_eval} (eval_fraction, at least micro_batch rows) plus training rows")
    return usable_rows - n_eval, n_eval


def batches_per_epoch(train_rows: int, micro_batch: int, data_parallel: int) -> int:
    """Micro-batches each data-parallel rank draws per epoch (the ragged tail is dropped)."""
    batches = train_rows // data_parallel // micro_batch
    if batches == 0:
        raise ValueError(
            f"{train_rows} training rows are fewer than micro_batch ({micro_batch}) x "
            f"data-parallel processes ({data_parallel}): one step needs "
            f"{micro_batch * data_parallel} rows; lower micro_batch or give more data")
    return batches


def optimizer_steps(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """The run's optimizer steps: max_steps, or (max_steps 0) `epochs` passes over the data, of
    which each data-parallel rank draws batches_per_epoch micro-batches, grad_accum per step."""
    return cfg.max_steps or math.ceil(cfg.epochs * batches_per_epoch / cfg.grad_accum)


def expected_packed_rows(lengths: list[int], seq_len: int, train_rows: int) -> int:
    """About how many sequences a random `train_rows` of these examples pack into: their
    expected total length over seq_len (packing leaves a short row per 1000 examples)."""
    total = sum(lengths) * train_rows / max(len(lengths), 1)
    return max(1, math.ceil(total / seq_len))


def min_packed_rows(lengths: list[int], seq_len: int, train_rows: int) -> int:
    """The fewest sequences `train_rows` of these examples can pack into (the shortest ones
    chosen): the split is random, so this is what validate can promise with packing on."""
    shortest = sorted(lengths)[:train_rows]
    return math.ceil(sum(shortest) / seq_len)


# -- reading files without `datasets` ----------------------------------------------------------


@dataclass
class FileRows:
    """Rows read from local data files, with where each came from."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    places: list[str] = field(default_factory=list)
    malformed: list[tuple[str, str]] = field(default_factory=list)  # (place, what)
    columns: list[str] = field(default_factory=list)  # in first-seen order


def read_rows(files: list[str], dataset_format: str, limit: int) -> FileRows | None:
    """The rows of local data files as the trainer sees them, up to `limit` rows; None for
    formats this package cannot read alone (parquet without pyarrow). ValueError naming the
    file when one is not of its format (a JSON file holding one object, say)."""
    out = FileRows()
    seen: dict[str, None] = {}
    for file in files:
        fmt = file_format(file, dataset_format)
        rows = _file_rows(file, fmt, out)
        if rows is None:
            return None
        for place, row in rows:
            out.rows.append(row)
            out.places.append(place)
            seen.update(dict.fromkeys(row))
            if len(out.rows) + len(out.malformed) >= limit:
                break
    out.columns = list(seen)
    return out


def _file_rows(file: str, fmt: str, out: FileRows) -> Iterator[tuple[str, dict]] | None:
    if fmt == "jsonl":
        return _jsonl(file, out)
    if fmt == "json":
        try:
            data = json.loads(Path(file).read_text())
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"dataset file {file} is not JSON: {exc}") from None
        if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
            kind = type(data).__name__ if not isinstance(data, list) else "list of non-objects"
            raise ValueError(f"dataset file {file} holds a JSON {kind}; a .json data file "
                             "holds a list of objects (one per row), or use jsonl")
        return ((f"{file} row {i}", row) for i, row in enumerate(data, 1))
    if fmt == "csv":
        with open(file, newline="", encoding="utf-8", errors="replace") as f:
            rows = list(csv.DictReader(f))
        return ((f"{file} row {i}", row) for i, row in enumerate(rows, 1))
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            return None
        table = pq.read_table(file)
        return ((f"{file} row {i}", row) for i, row in enumerate(table.to_pylist(), 1))
    raise ValueError(f"unknown dataset format {fmt!r}")


def _jsonl(file: str, out: FileRows) -> Iterator[tuple[str, dict]]:
    with open(file, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            place = f"{file} line {number}"
            try:
                parsed = json.loads(line)
            except ValueError as exc:
                out.malformed.append((place, f"not JSON ({exc})"))
                continue
            if isinstance(parsed, dict):
                yield place, parsed
            else:
                out.malformed.append((place, f"a JSON {type(parsed).__name__}, not an object"))


def tokenizer_problems(path: Path, field_name: str, cfg: TrainConfig) -> list[tuple[str, str]]:
    """A tokenizer directory that cannot load (no tokenizer files) or has no chat template
    when prompt_template is chat or the rows are conversations (see chat_template_problem)."""
    if not path.is_dir():
        return [(field_name, f"directory {quoted(str(path))} does not exist")]
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return [(field_name, f"directory {quoted(str(path))} has no tokenizer files (one of "
                 f"{', '.join(TOKENIZER_FILES)})")]
    if cfg.prompt_template == "chat" and not cfg.messages_field and not has_chat_template(path):
        return [("prompt_template", f"chat, but the tokenizer in {quoted(str(path))} has no "
                 "chat template (tokenizer_config.json chat_template, chat_template.jinja): use "
                 "prompt_template instruction or a tokenizer with a chat template")]
    problem = chat_template_problem(path, cfg)
    return [("messages_field", problem)] if problem else []


def chat_template_problem(path: Path, cfg: TrainConfig) -> str | None:
    """Rows of conversations (messages_field, as row_format found it) with a tokenizer that has
    no chat template to render them."""
    if not cfg.messages_field or has_chat_template(path):
        return None
    return (f"the rows are conversations (column {quoted(cfg.messages_field)}), rendered with "
            f"the tokenizer's chat template, and the tokenizer in {quoted(str(path))} has none "
            "(tokenizer_config.json chat_template, chat_template.jinja): give a tokenizer with "
            "a chat template")


def has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
