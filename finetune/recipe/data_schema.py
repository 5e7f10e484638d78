"""The data section of the recipe schema (`data.*`: where the training rows come from, their format and the maps that
read other column and role names, how they are tokenized, labeled and batched). `finetune/recipe/schema.py` holds the
rest of the tree; this module imports only the key declarations (`fields.py`) and the batching modes."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from finetune.recipe.batch_modes import MODES
from finetune.recipe.fields import mapping, number, one_of, setting


@dataclass
class MixtureSource:
    """One source of data.mixture, read with the data.* keys except those it sets itself."""

    source: str = setting(MISSING, help="as data.source")
    weight: float = setting(1.0, help="its share of the training rows: weight / the sum of the weights")
    name: str | None = setting(
        None, help="in the data line and eval_<name>_loss; default: the file's stem (or the source)"
    )
    format: str | None = setting(None, help="default: data.format")
    loss_on: str | None = setting(None, help="default: data.loss_on")
    split: str | None = setting(None, help="a hub dataset's split; default: data.split")


# the fields of a data row that data.columns can read from a column of another name (finetune/data/formats.py)
ROW_FIELDS = (
    "messages",
    "conversations",
    "instruction",
    "input",
    "output",
    "system",
    "history",
    "prompt",
    "completion",
    "text",
    "tools",
)


@dataclass
class DataConfig:
    """The training rows: where they come from, how they are tokenized, labeled and batched."""

    source: str = setting(
        "stdlib_docs", help="stdlib_docs | shapes_captions | a jsonl/json/parquet/csv file or folder | a hub id"
    )
    split: str = setting("train", help="the split of a hub dataset")
    # auto: the first whose columns a row has: messages, conversations (sharegpt), instruction + output (alpaca),
    # prompt + completion, text. ShareGPT and Alpaca rows become messages (docs/data.md shows a row of each)
    format: str = one_of(
        "auto",
        "messages",
        "sharegpt",
        "alpaca",
        "prompt_completion",
        "text",
        help="the rows' columns; auto: detected from the rows (sharegpt and alpaca rows become messages)",
    )
    columns: dict[str, str] = mapping(
        keys=ROW_FIELDS,
        help="{field: your column}: a field read from a column of another name, e.g. {prompt: question}",
    )
    # ShareGPT's human, gpt, observation (tool) and function_call (assistant) are known without it
    roles: dict[str, str] = mapping(
        values=("user", "assistant", "system", "tool"),
        help="{your role: user|assistant|system|tool} for messages and conversations rows, e.g. {bot: assistant}",
    )
    message_keys: dict[str, str] = mapping(
        keys=("role", "content"),
        help="a message's keys, e.g. {role: from, content: value}; default role/content (sharegpt: from/value)",
    )
    max_length: int = number(1024, min=1, help="tokens per row at most (see data.truncation)")
    truncation: str = one_of(
        "right", "drop", "error", help="a row over data.max_length: cut at the end, dropped (counted), or an error"
    )
    loss_on: str = one_of(
        "assistant", "completion", "all", help="tokens trained on: every assistant turn, the last one, or all tokens"
    )
    # a conversation rendered whole, as the template renders it (earlier turns' reasoning dropped where it drops it,
    # as at inference), or one row per trained assistant turn, that turn last (its own reasoning kept)
    turn_rows: str = one_of(
        "conversation",
        "per_turn",
        help="conversation: one row per conversation, rendered whole; per_turn: one row per assistant turn, ending "
        "with it (each turn with its own reasoning)",
    )
    on_bad_row: str = one_of("error", "skip", help="a malformed row: an error naming it, or skipped and counted")
    limit: int | None = number(None, min=1, help="keep the first N rows (quick runs)")
    batching: str = one_of(*MODES, help="how rows become micro-batches (finetune/recipe/batch_modes.py)")
    max_tokens_per_micro_batch: int | None = number(
        None, min=1, help="token budget per micro-batch: token_budget, or packed by tokens"
    )
    num_workers: int = number(0, min=0, help="DataLoader worker processes")
    streaming: bool = setting(False, help="read, tokenize and label rows as training goes (data larger than memory)")
    system_prompt: str | None = setting(
        None, help="a system turn for chat rows without one; null: the chat template's own default (if it adds one)"
    )
    text_eos: bool = setting(
        True, help="text rows end with the tokenizer's EOS token (trained on, so the model learns to stop)"
    )
    chat_template: str | None = setting(
        None, help="chatml (built in) or a Jinja file: replaces the tokenizer's chat template"
    )
    # several sources drawn at chosen shares (seeded) instead of data.source: [{source, weight, name, format, …}]
    mixture: list[MixtureSource] = setting(
        [], help="several sources drawn at chosen shares (seeded) instead of data.source: [{source, weight, …}]"
    )
