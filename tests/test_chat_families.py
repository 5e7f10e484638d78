"""Assistant-only labels on the chat templates models ship (tests/fixtures/chat_templates, sources in its
SOURCES.md), each × single, multi-turn, system, reasoning and tool rows, through load_sft_dataset as a user's run
reads them.

The expectation is written per family by hand from what its template is known to render (the `Family` table): the
header the model is prompted with, the token that ends an earlier and a last turn, which reasoning and tool calls it
shows. Each row's labelled runs are decoded and checked against it: one run per assistant turn, starting right after
a header, holding the turn's text (its reasoning and tool call where the family renders them), ending with the
family's end token, and holding nothing of the system, user and tool turns nor the tool schemas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from finetune.data.text import load_sft_dataset
from finetune.recipe import DataConfig, RecipeError
from tests.data_files import smollm2_folder, write_jsonl

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
# the control tokens a template writes as literals: added to SmolLM2's tokenizer so each is one token, as in the
# family's own vocabulary (<think> and the tool tags are plain added tokens there, the rest special)
CONTROL = re.compile(
    r"<\|[^|<>\s]{1,40}\|>|<｜[^｜]{1,40}｜>|<[A-Za-z_][\w\-]{0,30}\|>|<\|[\w\-]{1,30}>|\[/?[A-Z_]{2,20}\]"
    r"|</?(?:think|start_of_turn|end_of_turn|tool_call|tool_response)>"
)
PLAIN = {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}


@dataclass(frozen=True)
class Family:
    bos: str | None
    eos: str
    headers: tuple[str, ...]  # what comes right before an assistant turn's targets
    end: str  # the token that ends an earlier turn
    last_end: str | None = None  # ... the last turn, where it differs (gpt-oss: <|return|>)
    call_end: str | None = None  # ... a turn that calls a tool, where it differs
    reasoning: str = "none"  # reasoning_content shown for: "none", "last" (after the last user turn), "all"
    inline: bool = True  # inline <think>…</think> content kept as written
    tools: str | None = None  # None: renders tool calls and results; else the refusal's words
    system: str | None = None  # None: renders a system turn; else the refusal's words
    text_with_call: bool = True  # shows an assistant turn's text beside its tool call
    calls: bool = True  # shows a tool call (else it trains the turn's text without it, and says so)
    stop_appended: bool = False  # GLM: the next role's token appended after the last turn
    refused: dict = field(default_factory=dict)  # row kind: the refusal's words, for kinds the above does not say


CHATML = ("<|im_start|>assistant\n",)
LLAMA3 = ("<|start_header_id|>assistant<|end_header_id|>\n\n",)
DEEPSEEK = ("<｜Assistant｜>", "<｜tool▁outputs▁end｜>")
NO_TOOL_ROLE = r"messages\[2\]\.role='tool' is not a chat role"
NOTHING_OF_CALL = r"renders nothing of messages\[1\] \(assistant: tool_calls dropped\)"
OUT_OF_ORDER = r"renders messages\[2\] \(tool\) inside or before messages\[1\] \(assistant\)"
NO_TOOLS = r"tools \(1 schema\): the chat template never reads `tools`"
FAMILIES = {
    "qwen2_5": Family(None, "<|im_end|>", CHATML, "<|im_end|>"),
    "qwen3": Family(None, "<|im_end|>", CHATML, "<|im_end|>", reasoning="last"),
    "qwen3_5_think": Family(
        None, "<|im_end|>", (*CHATML, "<|im_start|>assistant\n<think>\n"), "<|im_end|>", reasoning="last"
    ),
    "qwen3_instruct_2507": Family(None, "<|im_end|>", CHATML, "<|im_end|>"),
    "gptoss": Family(
        None,
        "<|return|>",
        ("<|start|>assistant",),
        "<|end|>",
        "<|return|>",
        "<|call|>",
        reasoning="last",
        text_with_call=False,
    ),
    "llama3": Family("<|begin_of_text|>", "<|eot_id|>", LLAMA3, "<|eot_id|>", tools=NO_TOOL_ROLE),
    "llama3_1": Family("<|begin_of_text|>", "<|eot_id|>", LLAMA3, "<|eot_id|>", text_with_call=False),
    "llama3_2": Family("<|begin_of_text|>", "<|eot_id|>", LLAMA3, "<|eot_id|>", text_with_call=False),
    "gemma": Family(
        "<bos>",
        "<eos>",
        ("<start_of_turn>model\n",),
        "<end_of_turn>",
        tools=NO_TOOL_ROLE,
        system="System role not supported",
    ),
    "gemma3": Family("<bos>", "<eos>", ("<start_of_turn>model\n",), "<end_of_turn>", tools=NO_TOOL_ROLE),
    "gemma4": Family(
        "<bos>",
        "<eos>",
        ("<|turn>model\n", "<tool_response|>"),
        "<turn|>",
        call_end="<tool_call|>",
        text_with_call=False,
        refused={"tool_call_text": OUT_OF_ORDER},
    ),
    "phi3": Family("<s>", "<|endoftext|>", ("<|assistant|>\n",), "<|end|>", tools=NO_TOOL_ROLE),
    "phi3_5": Family("<s>", "<|endoftext|>", ("<|assistant|>\n",), "<|end|>", tools=NO_TOOL_ROLE),
    "deepseekv3": Family(
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        inline=False,
        tools=NO_TOOLS,
    ),
    "deepseek_r1_distill": Family(
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        inline=False,
        tools=NO_TOOLS,
    ),
    "glm4moe": Family(
        None,
        "<|endoftext|>",
        ("<|assistant|>",),
        "<|user|>",
        call_end="<|observation|>",
        reasoning="last",
        stop_appended=True,
    ),
    "lfm2": Family(
        "<|startoftext|>", "<|im_end|>", CHATML, "<|im_end|>", calls=False, refused={"tool_call": NOTHING_OF_CALL}
    ),
    "lfm2_2_5": Family("<|startoftext|>", "<|im_end|>", CHATML, "<|im_end|>\n", reasoning="last"),
    "cohere2": Family(
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        ("<|START_RESPONSE|>",),
        "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>",
        tools=NO_TOOL_ROLE,
    ),
    "nemotron_3_nano": Family(
        None, "<|im_end|>", (*CHATML, "<|im_start|>assistant\n<think>\n"), "<|im_end|>", reasoning="last"
    ),
    "smollm3": Family(
        None, "<|im_end|>", ("<|im_end|>\n",), "<|im_end|>\n", calls=False, refused={"tool_call": NOTHING_OF_CALL}
    ),
    "phi4": Family(None, "<|im_end|>", ("<|im_start|>assistant<|im_sep|>",), "<|im_end|>", tools=NO_TOOL_ROLE),
    "phi4_mini": Family(None, "<|endoftext|>", ("<|assistant|>",), "<|end|>", tools=NO_TOOL_ROLE),
    "olmo3_think": Family(
        None,
        "<|endoftext|>",
        (*CHATML, "<|im_start|>assistant\n<think>"),
        "<|im_end|>",
        "<|endoftext|>",
        tools=NO_TOOL_ROLE,
    ),
    "tulu3": Family(
        "<|begin_of_text|>", "<|end_of_text|>", ("<|assistant|>\n",), "<|end_of_text|>", tools=NO_TOOL_ROLE
    ),
    "deepseek_r1": Family(
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        DEEPSEEK,
        "<｜end▁of▁sentence｜>",
        inline=False,
        tools=NO_TOOLS,
    ),
    "ministral_3_reasoning": Family("<s>", "</s>", ("[/INST]", "[/TOOL_RESULTS]"), "</s>"),
    "granite_4_0": Family(None, "<|end_of_text|>", ("<|start_of_role|>assistant<|end_of_role|>",), "<|end_of_text|>"),
}
# templates that build a role's token from its name ('<|' + role + '|>')
ROLE_TOKENS = {"phi4_mini": ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **fields):
    return {"role": "assistant", "content": text, **fields}


CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_RESULT = {"role": "tool", "content": "Sunny, 21 C"}
ROWS = {
    "single": [user("What is two plus two?"), assistant("Two plus two is four.")],
    "multi": [user("Name a colour."), assistant("Blue is a colour."), user("Another one?"), assistant("Green.")],
    "three": [
        user("Q one?"),
        assistant("Answer one."),
        user("Q two?"),
        assistant("Answer two."),
        user("Q 3?"),
        assistant("Three."),
    ],
    "system": [{"role": "system", "content": "You are terse."}, user("Capital of Spain?"), assistant("Madrid.")],
    "reasoning": [user("Is seven prime?"), assistant("Yes, seven is prime.", reasoning_content="No divisors but one.")],
    "reasoning_multi": [
        user("Is nine prime?"),
        assistant("No, it is three squared.", reasoning_content="Nine is three times three."),
        user("And eleven?"),
        assistant("Eleven is prime.", reasoning_content="Eleven has no small divisors."),
    ],
    "inline_think": [user("Is five odd?"), assistant("<think>\nFive leaves one over.\n</think>\n\nYes, five is odd.")],
    "tool_call": [user("Weather in Paris?"), assistant("", tool_calls=CALL), TOOL_RESULT, assistant("It is sunny.")],
    "tool_call_text": [
        user("Weather in Paris?"),
        assistant("Let me check.", tool_calls=CALL),
        TOOL_RESULT,
        assistant("Sunny."),
    ],
}


def family_tokenizer(name: str):
    family, template = FAMILIES[name], (FIXTURES / f"{name}.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    controls = set(CONTROL.findall(template)) | {t for t in (family.bos, family.eos) if t}
    controls = sorted(controls | set(ROLE_TOKENS.get(name, [])))
    tok.add_tokens([t for t in controls if t in PLAIN])
    specials = [t for t in controls if t not in PLAIN]
    tok.add_special_tokens({"additional_special_tokens": specials}, replace_extra_special_tokens=False)
    tok.bos_token, tok.eos_token, tok.chat_template = family.bos, family.eos, template
    return tok


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, family_tokenizer(request.param)


def labelled_runs(tok, ids: list[int], labels: list[int]) -> list[tuple[str, str]]:
    """(the text before it, the text of) each run of consecutive targets, decoded."""
    runs, start = [], None
    for k, label in enumerate([*labels, -100]):
        if label != -100 and start is None:
            start = k
        elif label == -100 and start is not None:
            runs.append((tok.decode(ids[:start]), tok.decode(ids[start:k])))
            start = None
    return runs


def expected_end(family: Family, messages: list[dict], k: int) -> str:
    if messages[k].get("tool_calls") and family.call_end:
        return family.call_end
    last = k == len(messages) - 1
    return family.last_end if last and family.last_end else family.end


def check_turn(family: Family, messages: list[dict], k: int, before: str, run: str) -> None:
    """One assistant turn's run against what the family renders of it."""
    turn = messages[k]
    assert any(before.endswith(h) or (before + run[:1]).endswith(h) for h in family.headers), (before[-40:], run)
    assert run.endswith(expected_end(family, messages, k)), run
    text = turn["content"]
    if "</think>" in text:
        reasoning, text = text.split("</think>")[0].split("<think>")[-1].strip(), text.split("</think>")[1].strip()
        assert (reasoning in run) == family.inline, run
    if text and (family.text_with_call or not turn.get("tool_calls")):
        assert text in run, run
    if turn.get("reasoning_content"):
        after_last_user = k > max(i for i, m in enumerate(messages) if m["role"] == "user")
        shown = family.reasoning == "all" or family.reasoning == "last" and after_last_user
        assert (turn["reasoning_content"] in run) == shown, (family.reasoning, run)
    if turn.get("tool_calls"):
        assert ("get_weather" in run and "Paris" in run) == family.calls, run


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_each_assistant_turn_is_labelled_as_its_template_renders_it(family, kind, tmp_path):
    name, tok = family
    spec, messages = FAMILIES[name], ROWS[kind]
    path = write_jsonl(
        tmp_path / "rows.jsonl", [{"messages": messages, **({"tools": TOOLS} if "tool" in kind else {})}]
    )
    refusal = spec.tools if "tool" in kind else spec.system if kind == "system" else None
    refusal = spec.refused.get(kind, refusal)
    if refusal is not None:
        with pytest.raises(RecipeError, match=r"rows\.jsonl line 1: .*" + refusal):
            load_sft_dataset(DataConfig(source=str(path)), tok)
        return
    dataset, report = load_sft_dataset(DataConfig(source=str(path)), tok)
    row = dataset[0]
    runs = labelled_runs(tok, row["input_ids"], row["labels"])
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(runs) == len(turns), runs
    for k, (before, run) in zip(turns, runs):
        check_turn(spec, messages, k, before, run)
    others = [m["content"] for m in messages if m["role"] != "assistant"] + ["Weather of a city"]
    assert not [t for t in others for _, run in runs if t in run], runs
    assert (report.stop_rows == 1) == spec.stop_appended
    calls = sum(1 for m in messages if m.get("tool_calls"))
    assert report.dropped["tool_calls"] == (0 if spec.calls else calls)


def test_the_template_drops_are_said_once_with_counts(tmp_path):
    tok = family_tokenizer("qwen3")
    rows = [{"messages": ROWS["reasoning_multi"]}] * 3 + [{"messages": ROWS["reasoning"]}]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    dataset, report = load_sft_dataset(DataConfig(source=str(path)), tok)
    assert report.notes() == [
        "the chat template drops the reasoning of 3 of the 7 trained assistant turns that carry it: they train without "
        "it; data.turn_rows=per_turn trains each turn with its own (the template renders a last turn's)"
    ]
    per_turn, per_report = load_sft_dataset(DataConfig(source=str(path), turn_rows="per_turn"), tok)
    assert len(per_turn) == 7 and per_report.notes() == []
    for row, (_, reasoning) in zip(per_turn, [(0, "Nine is three"), (1, "Eleven has no")] * 3 + [(0, "No divisors")]):
        runs = labelled_runs(tok, row["input_ids"], row["labels"])
        assert reasoning in runs[-1][1], runs  # each turn trained with its own reasoning, as it was generated
    # the data line gives the other choice's figures
    assert f"data.turn_rows=per_turn would give 7 rows, {per_report.target_tokens:,} targets" in report.summary()
    assert f"data.turn_rows=conversation would give 4 rows, {report.target_tokens:,} targets" in per_report.summary()


def test_a_refusal_for_turns_out_of_order_names_a_way_that_runs(tmp_path):
    tok = family_tokenizer("gemma4")  # renders a tool call's text after the tool's result
    path = write_jsonl(tmp_path / "rows.jsonl", [{"messages": ROWS["tool_call_text"], "tools": TOOLS}])
    with pytest.raises(RecipeError, match=OUT_OF_ORDER + r".*data\.turn_rows=per_turn .* or data\.loss_on=completion"):
        load_sft_dataset(DataConfig(source=str(path)), tok)
    for way in ({"turn_rows": "per_turn"}, {"loss_on": "completion"}):
        dataset, _ = load_sft_dataset(DataConfig(source=str(path), **way), tok)
        runs = [run for row in dataset for _, run in labelled_runs(tok, row["input_ids"], row["labels"])]
        assert runs[-1].endswith("Sunny.<turn|>") and not any("Sunny, 21 C" in run for run in runs), runs
        assert len(runs) == (2 if way.get("turn_rows") else 1)
