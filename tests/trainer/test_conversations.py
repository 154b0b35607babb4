"""Conversations encoded with real tokenizers' chat templates (the demo tokenizer's, a Qwen-style
one with {% generation %} marks, a Llama 3-style one without and a Qwen3-style one that renders a
turn otherwise once another follows, tests/support/chat_tokenizers):
the loss on every assistant turn and nowhere else, checked by decoding; tool calls and results as
the template renders them; ShareGPT's shape; conversations found by themselves in jsonl and
parquet; a row the template cannot render, or longer than seq_len, a bad row named by its line."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from finetune_data import prepared_set as prep
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from finetune_contract.data import IGNORE_INDEX, encode_row, has_generation_marks
from tests.support.chat_tokenizers import make_chat_tokenizer
from tests.support.training import write_jsonl
from trainer.config import load_config
from trainer.demo import DEMO_CONVERSATIONS, DEMO_TOKENIZER

FAMILIES = ("demo", "qwen", "llama3", "qwen3")
# What the Qwen3-style template puts before the last turn's content: its (empty) reasoning.
EMPTY_THINKING = "<think>\n\n</think>\n\n"

MULTI_TURN = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Which day comes after Monday?"},
    {"role": "assistant", "content": "Tuesday"},
    {"role": "user", "content": "And after Friday?"},
    {"role": "assistant", "content": "Saturday"},
    {"role": "user", "content": "Write in capitals: owl"},
    {"role": "assistant", "content": "OWL"},
]
TOOL_CALL = [
    {"role": "user", "content": "What is 7 plus 8?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": '{"a": 7, "b": 8}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "15"},
    {"role": "assistant", "content": "It is 15."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """family -> a tokenizer directory: the demo's own, and the two made on it."""
    made = {family: str(make_chat_tokenizer(tmp_path_factory.mktemp(family), family))
            for family in FAMILIES if family != "demo"}
    return {"demo": str(DEMO_TOKENIZER), **made}


def conversation_config(tokenizer: str, **changes):
    return load_config(None, {"tokenizer": tokenizer, "messages_field": "messages",
                              "seq_len": 1024, **changes})


def labelled_runs(labels: list[int]) -> list[list[int]]:
    """The labelled tokens, as runs of consecutive positions."""
    runs: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in labels:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(label)
        previous = label
    return runs


def said(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_the_four_templates_are_one_with_generation_marks_and_three_without(tokenizers):
    marked = {family: has_generation_marks(AutoTokenizer.from_pretrained(path))
              for family, path in tokenizers.items()}
    assert marked == {"demo": False, "qwen": True, "llama3": False, "qwen3": False}


def flat(text: str) -> str:
    return re.sub(r"\s", "", text)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_assistant_turn_and_only_it_carries_the_loss(tokenizers, family):
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[family])
    problem, input_ids, labels = encode_row(tokenizer, conversation_config(tokenizers[family]),
                                            {"messages": MULTI_TURN})
    assert problem is None and len(input_ids) == len(labels)
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(input_ids, labels))
    replies = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
    if family == "qwen3":  # the last turn as generated: its reasoning block, then the reply
        replies[-1] = EMPTY_THINKING + replies[-1]
    # One run of labels per assistant turn, each decoding to that turn's words alone (its
    # end-of-turn marker is a special token or a line break).
    assert [flat(said(tokenizer, run)) for run in labelled_runs(labels)] == \
        [flat(reply) for reply in replies]
    # Everything else (the system prompt, the users' turns, the template's role markers) has
    # no label: the unlabelled text holds them and no reply.
    unlabelled = said(tokenizer, [t for t, label in zip(input_ids, labels)
                                  if label == IGNORE_INDEX])
    for message in MULTI_TURN:
        assert (message["content"] in unlabelled) == (message["role"] != "assistant"), message
    # The ids are the template's rendering of the whole conversation.
    rendered = tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)
    assert re.sub(r"\s", "", tokenizer.decode(input_ids)) == re.sub(r"\s", "", rendered)


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_calls_and_results_are_kept_as_the_template_renders_them(tokenizers, family):
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[family])
    row = {"messages": TOOL_CALL, "tools": TOOLS}
    problem, input_ids, labels = encode_row(tokenizer, conversation_config(tokenizers[family]),
                                            row)
    assert problem is None
    call, answer = [said(tokenizer, run) for run in labelled_runs(labels)]
    # The assistant's call (its name and arguments, as an object) carries the loss, as the
    # template writes it; the tool's result and the tools' schemas carry none.
    assert "add" in call and re.search(r'"a":\s*7', call) and re.search(r'"b":\s*8', call)
    assert flat(answer) == flat((EMPTY_THINKING if family == "qwen3" else "") + "It is 15.")
    unlabelled = said(tokenizer, [t for t, label in zip(input_ids, labels)
                                  if label == IGNORE_INDEX])
    assert "15" in unlabelled.replace("It is 15.", "") and "What is 7 plus 8?" in unlabelled
    # As the encoding hands it on: no null content, the call's arguments an object.
    messages = [{**m, "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 7, "b": 8}}}]} if m.get("tool_calls") else m
        for m in TOOL_CALL]
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert re.sub(r"\s", "", tokenizer.decode(input_ids)) == re.sub(r"\s", "", rendered)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharegpt_rows_encode_as_the_same_conversation_in_openais_shape(tokenizers, family):
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[family])
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]}
                                  for m in MULTI_TURN]}
    config = conversation_config(tokenizers[family])
    shared = encode_row(tokenizer, load_config(None, {
        **{k: getattr(config, k) for k in ("tokenizer", "seq_len")},
        "messages_field": "conversations"}), sharegpt)
    assert shared == encode_row(tokenizer, config, {"messages": MULTI_TURN})


def test_conversations_are_found_by_themselves_in_jsonl_and_parquet(tmp_path, tokenizers):
    """dataset_format auto, messages_field empty: a messages (OpenAI) or conversations
    (ShareGPT) column is read as conversations, each row encoded as encode_row does; a parquet
    file's messages come back with Arrow's nulls for the keys a message lacks."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["llama3"])
    rows = [json.loads(line) for line in DEMO_CONVERSATIONS.read_text().splitlines()[:60]]
    jsonl = write_jsonl(tmp_path / "chats.jsonl", rows)
    parquet = tmp_path / "chats.parquet"
    pd.DataFrame(rows).to_parquet(parquet)
    expected = sorted(encode_row(tokenizer, conversation_config(tokenizers["llama3"]), row)[1:]
                      for row in rows)
    for path in (jsonl, parquet):
        config = load_config(None, {"dataset": str(path), "tokenizer": tokenizers["llama3"],
                                    "output_dir": str(tmp_path / "out")})
        assert config.messages_field is None
        stats = prep.prepare(config, tmp_path / f"prepared-{path.suffix[1:]}", num_proc=1)
        assert stats["row_format"] == "conversations" and stats["rows_kept"] == len(rows)
        train, held_out, _ = prep.load_prepared(stats["path"])
        assert sorted((r["input_ids"], r["labels"]) for r in (*train, *held_out)) == expected


def test_a_rows_tools_are_kept_when_the_rows_that_show_the_columns_have_none(
        tmp_path, tokenizers, monkeypatch):
    """The first rows say which columns to read (COLUMNS_SEEN_ROWS); a tool-calling row after
    them keeps its tool schemas in its prompt, as encode_row renders it alone."""
    monkeypatch.setattr(prep, "COLUMNS_SEEN_ROWS", 2)
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["qwen"])
    rows = [{"messages": MULTI_TURN}] * 20 + [{"messages": TOOL_CALL, "tools": TOOLS}] * 4
    config = load_config(None, {"dataset": str(write_jsonl(tmp_path / "chats.jsonl", rows)),
                                "tokenizer": tokenizers["qwen"], "seq_len": 1024,
                                "micro_batch": 1, "output_dir": str(tmp_path / "out")})
    stats = prep.prepare(config, tmp_path / "prepared", num_proc=1)
    train, held_out, _ = prep.load_prepared(stats["path"])
    with_tools = encode_row(tokenizer, conversation_config(tokenizers["qwen"]), rows[-1])[1:]
    assert with_tools in [(r["input_ids"], r["labels"]) for r in (*train, *held_out)]
    assert "a + b" in tokenizer.decode(with_tools[0])  # the schema's description


def test_the_demo_conversations_are_what_the_generator_makes_and_fit_the_demo(tokenizers):
    from trainer.demo.make_data import make_conversation_rows

    rows = [json.loads(line) for line in DEMO_CONVERSATIONS.read_text().splitlines()]
    assert rows == make_conversation_rows(1000, 3)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    config = load_config(None, {"messages_field": "messages"})  # the demo's seq_len
    encoded = [encode_row(tokenizer, config, row) for row in rows]
    assert all(problem is None for problem, _, _ in encoded)
    assert sum(any(m.get("tool_calls") for m in row["messages"]) for row in rows) == 200


RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('this template has no tool role') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tool_refusing_tokenizer(tmp_path_factory) -> str:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.chat_template = RAISING_TEMPLATE
    path = tmp_path_factory.mktemp("no-tools")
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_row_the_template_cannot_render_is_a_bad_row_named_by_file_and_line(
        tmp_path, tool_refusing_tokenizer):
    rows = [{"messages": MULTI_TURN[1:3]}] * 30 + [{"messages": TOOL_CALL}] + \
        [{"messages": MULTI_TURN[1:3]}] * 9
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    values = {"dataset": str(data), "tokenizer": tool_refusing_tokenizer,
              "output_dir": str(tmp_path / "out")}
    stats = prep.prepare(load_config(None, values), tmp_path / "skipped", num_proc=1)
    assert stats["skipped_rows_by_reason"] == {"template_error": 1}
    assert stats["longest_skipped_rows"][0]["where"] == f"{data} line 31"
    with pytest.raises(ValueError, match=rf"{re.escape(str(data))} line 31: the chat template "
                       r"cannot render it: TemplateError: this template has no tool role"):
        prep.prepare(load_config(None, {**values, "bad_rows": "error"}), tmp_path / "error",
                     num_proc=1)
    assert not list((tmp_path / "error").glob("*"))


def test_a_conversation_longer_than_seq_len_is_a_bad_row_never_cut(tokenizers):
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["qwen"])
    long = {"messages": MULTI_TURN * 6}
    fits = encode_row(tokenizer, conversation_config(tokenizers["qwen"]), long)
    assert fits[0] is None
    problem, input_ids, labels = encode_row(
        tokenizer, conversation_config(tokenizers["qwen"], seq_len=len(fits[1]) - 1), long)
    assert problem == ("too_long", f"{len(fits[1])} tokens, more than seq_len "
                       f"{len(fits[1]) - 1}") and input_ids == labels == []


def test_a_template_whose_turns_are_not_the_assistants_words_is_refused_for_the_row(tmp_path):
    """Without generation marks the labelled spans must decode to the assistant's content: a
    template that rewrites it (here in capitals) would teach words nobody wrote."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tokenizer.chat_template = RAISING_TEMPLATE.replace("{{ m['content'] }}",
                                                       "{{ m['content'] | upper }}")
    problem, _, _ = encode_row(tokenizer, conversation_config(str(DEMO_TOKENIZER)),
                               {"messages": MULTI_TURN[1:3]})
    assert problem[0] == "template_error" and "'TUESDAY', not its content 'Tuesday'" in problem[1]


@pytest.mark.parametrize(("messages", "reason", "words"), [
    ("not json", "malformed", "not JSON"),
    ([{"role": "user", "content": "hi"}], "empty", "no assistant turn"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}], "malformed",
     "message 1 is the assistant's"),
    ([{"role": "narrator", "content": "hi"}], "malformed", "role 'narrator'"),
    ([{"role": "user", "content": " "}, {"role": "assistant", "content": "x"}], "empty",
     "message 1 (user) is empty"),
    ([], "empty", "an empty list"),
])
def test_rows_that_are_no_conversation_are_bad_rows_by_reason(messages, reason, words):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    problem, _, _ = encode_row(tokenizer, conversation_config(str(DEMO_TOKENIZER)),
                               {"messages": messages})
    assert problem[0] == reason and words in problem[1], problem


def test_an_earlier_turns_reasoning_is_left_out_as_the_template_does_and_the_last_learnt(
        tokenizers):
    """Qwen3's template keeps the reasoning of the turns after the last user query alone: the
    ids are its rendering of the whole conversation (what the model reads as the conversation
    goes on), and the last turn's reasoning is learnt with its reply."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["qwen3"])
    messages = [
        {"role": "user", "content": "Which day comes after Monday?"},
        {"role": "assistant", "content": "Tuesday", "reasoning_content": "Monday plus one."},
        {"role": "user", "content": "And after Friday?"},
        {"role": "assistant", "content": "Saturday", "reasoning_content": "Friday plus one."},
    ]
    problem, input_ids, labels = encode_row(
        tokenizer, conversation_config(tokenizers["qwen3"]), {"messages": messages})
    assert problem is None
    assert [flat(said(tokenizer, run)) for run in labelled_runs(labels)] == \
        ["Tuesday", flat("<think>Friday plus one.</think>Saturday")]
    assert "Monday plus one." not in tokenizer.decode(input_ids)
    assert flat(tokenizer.decode(input_ids)) == \
        flat(tokenizer.apply_chat_template(messages, tokenize=False))


TURNS = st.lists(st.tuples(st.sampled_from(["answer", "tool call", "reasoning"]),
                           st.integers(0, 99)), min_size=1, max_size=4)


@settings(max_examples=25, deadline=None)
@given(turns=TURNS, system=st.booleans(), family=st.sampled_from(FAMILIES[1:]))
def test_any_conversation_is_the_templates_whole_rendering_with_each_reply_labelled(
        tokenizers, turns, system, family):
    """Whatever the template does to earlier turns (none, generation marks, or rendering them
    otherwise once another follows): the ids are its rendering of the whole conversation, and
    there is one labelled run per assistant turn, ending with that turn's reply."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[family])
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    replies = []
    for number, (kind, value) in enumerate(turns):
        messages.append({"role": "user", "content": f"Question {number}: {value} plus 1?"})
        if kind == "tool call":
            messages += [{"role": "assistant", "content": "", "tool_calls": [{
                "type": "function", "function": {"name": "add", "arguments": {"a": value,
                                                                               "b": 1}}}]},
                         {"role": "tool", "content": str(value + 1)}]
            replies.append(None)
        reply = {"role": "assistant", "content": f"It is {value + 1}."}
        if kind == "reasoning":
            reply["reasoning_content"] = f"{value} and one more."
        messages.append(reply)
        replies.append(reply["content"])
    problem, input_ids, labels = encode_row(
        tokenizer, conversation_config(tokenizers[family]), {"messages": messages,
                                                             "tools": TOOLS})
    assert problem is None, problem
    runs = [said(tokenizer, run) for run in labelled_runs(labels)]
    assert len(runs) == len(replies)
    for run, reply in zip(runs, replies, strict=True):
        assert flat(run).endswith(flat(reply)) if reply else "add" in run, (run, reply)
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert flat(tokenizer.decode(input_ids)) == flat(rendered)


def test_reasoning_written_into_the_content_is_rendered_and_labelled_as_the_template_does(
        tokenizers):
    """Qwen3's template takes reasoning from the content too (before </think>): an earlier
    turn's is dropped, the last turn's laid out anew, and both rows encode."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["qwen3"])
    messages = [
        {"role": "user", "content": "Which day comes after Monday?"},
        {"role": "assistant", "content": "<think>Monday plus one.</think>Tuesday"},
        {"role": "user", "content": "And after Friday?"},
        {"role": "assistant", "content": "<think>Friday plus one.</think>Saturday"},
    ]
    problem, input_ids, labels = encode_row(
        tokenizer, conversation_config(tokenizers["qwen3"]), {"messages": messages})
    assert problem is None, problem
    assert [flat(said(tokenizer, run)) for run in labelled_runs(labels)] == \
        ["Tuesday", flat("<think>Friday plus one.</think>Saturday")]
    assert flat(tokenizer.decode(input_ids)) == \
        flat(tokenizer.apply_chat_template(messages, tokenize=False))
