"""Bad recipes and settings: every numeric key against the bounds the schema declares, YAML that would silently lose
or multiply values, files that are not text, and the one boundary of every command (one `error:` line, exit 2; a bug
keeps its traceback, exit 70). Through the CLI where the behaviour is the CLI's."""

import dataclasses
import io
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from finetune.recipe import Config, RecipeError, load_config
from finetune.recipe.bounds import bounds_text
from finetune.recipe.yaml_reader import MAX_NODES
from tests.launch import ENV, ON_PATH, ROOT, TWO_RANKS, assert_one_error, call, turn_at_the_cores

DEBUG = str(ROOT / "recipes" / "debug.yaml")
DEBUG_TEXT = Path(DEBUG).read_text()


def numeric_keys(section=Config, prefix=""):
    """(dotted key, field) of every key the schema declares bounds for (schema.number)."""
    for f in dataclasses.fields(section):
        if "number" in f.metadata:
            yield prefix + f.name, f
        elif dataclasses.is_dataclass(f.default_factory):
            yield from numeric_keys(f.default_factory, f"{prefix}{f.name}.")


def out_of_bounds_values(f) -> list:
    """Values just outside the field's bounds, NaN and inf: what a user can mistype."""
    b = f.metadata["number"]
    values = []
    if b["min"] is not None:
        values.append(b["min"] if b["min_exclusive"] else b["min"] - 1)
    if b["max"] is not None:
        values.append(b["max"] if b["max_exclusive"] else b["max"] + 1)
    if "float" in str(f.type):
        values += [math.nan, math.inf]
    return values


def yaml_value(value) -> str:
    return ".nan" if value != value else (".inf" if value == math.inf else repr(value))


def test_every_numeric_key_has_bounds_and_every_number_field_is_declared():
    assert len(list(numeric_keys())) >= 40

    def undeclared(section, prefix=""):  # int/float keys (also in lists and maps) without schema.number bounds
        for f in dataclasses.fields(section):
            if dataclasses.is_dataclass(f.default_factory):
                yield from undeclared(f.default_factory, f"{prefix}{f.name}.")
            elif re.search(r"\b(int|float)\b", str(f.type)) and "number" not in f.metadata:
                yield prefix + f.name

    assert list(undeclared(Config)) == []


@pytest.mark.parametrize("key, f", list(numeric_keys()), ids=[k for k, _ in numeric_keys()])
def test_each_numeric_key_refuses_values_outside_its_bounds_naming_the_key(key, f):
    for value in out_of_bounds_values(f):
        text = yaml_value(value)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if isinstance(default, list):
            text = f"[{', '.join([text] * (f.metadata['number']['count'] or 1))}]"
        elif isinstance(default, dict):
            text = "{model: " + text + "}"
        with pytest.raises(RecipeError) as error:
            load_config([f"recipe={DEBUG}", f"{key}={text}"])
        assert str(error.value).startswith(key) or f"{key}." in str(error.value) or f"{key}=" in str(error.value), (
            key,
            text,
            str(error.value),
        )


def test_the_messages_are_worded_from_the_bounds():
    def b(**kw):
        return {
            "min": None,
            "max": None,
            "min_exclusive": False,
            "max_exclusive": False,
            "count": None,
            "hint": "",
            **kw,
        }

    assert bounds_text(b(min=0, min_exclusive=True)) == "positive"
    assert bounds_text(b(min=0)) == "≥ 0"
    assert bounds_text(b(min=1)) == "≥ 1"
    assert bounds_text(b(min=0, max=1, max_exclusive=True)) == "in [0, 1)"
    assert bounds_text(b(min=0, max=1, min_exclusive=True, max_exclusive=True)) == "in (0, 1)"
    for argv, message in [
        (["optim.lr=nan"], "optim.lr=nan is not a number; it must be positive"),
        (["optim.lr=-inf"], "optim.lr=-inf is not finite; it must be positive"),
        (["optim.lr_multipliers={lm_head: -1}"], "optim.lr_multipliers.lm_head=-1.0 must be positive (model.freeze"),
        (["optim.lr_multipliers={lm_head: .nan}"], "optim.lr_multipliers.lm_head=nan is not a number"),
        (["train.max_grad_norm=nan"], "train.max_grad_norm=nan is not a number; it must be ≥ 0 (0 turns clipping off)"),
        (["train.seed=-1"], "train.seed=-1 must be in [0, 4294967295]"),
        (["data.num_workers=-1"], "data.num_workers=-1 must be ≥ 0"),
        (["train.epochs=nan", "train.max_steps=-1"], "train.epochs=nan is not a number"),
        (["train.max_steps=-5"], "train.max_steps=-5 must be ≥ -1 (-1: train for train.epochs)"),
        (["model.config_overrides.rms_norm_eps=.nan"], "model.config_overrides.rms_norm_eps=nan is not a finite"),
        (["model.vision_config={layers: [1, .inf]}"], "model.vision_config.layers[1]=inf is not a finite number"),
        (["optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ]:
        with pytest.raises(RecipeError) as error:
            load_config([f"recipe={DEBUG}", *argv])
        assert message in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train.max_steps=0"], "train.max_steps=0 makes no optimizer step"),
        (["data.source="], "data.source is empty"),
        (["data.source=' '"], "data.source is empty"),
        (["model.name_or_path="], "model.name_or_path is empty"),
        (["train.micro_batch_size=auto", "data.streaming=true"], "train.micro_batch_size=auto plans with the data's"),
        (
            ["data.batching=token_budget", "data.max_tokens_per_micro_batch=64", "train.global_batch_tokens=-128"],
            "train.global_batch_tokens=-128 must be ≥ 1",
        ),  # was accumulation -2: zero steps, an untrained model "done"
        (["optim=3"], "optim is a section (name, lr, weight_decay, …), not a value; set its keys, e.g. optim.name=…"),
        (["recipe="], None),
        (["model.liger_kernels=maybe"], "model.liger_kernels='maybe' is not a valid value for this key"),
        (["train.compile_layer=true"], "unknown key 'train.compile_layer'; did you mean 'train.compile_layers'?"),
    ],
)
def test_settings_that_would_train_nothing_or_something_else_are_refused(argv, message):
    with pytest.raises(RecipeError) as error:
        load_config([*([] if argv[0].startswith("recipe=") else [f"recipe={DEBUG}"]), *argv])
    assert message is None or message in str(error.value), str(error.value)


# ---- YAML ----


def bomb(levels: int = 9) -> str:
    return "".join(
        f"      x{k}: &a{k} [" + ",".join([f"*a{k - 1}" if k else '"lol"'] * 9) + "]\n" for k in range(levels)
    )


@pytest.mark.parametrize(
    "text, message",
    [
        (
            DEBUG_TEXT + "optim:\n  name: sgd\n",
            r"'optim' is written twice in one mapping \(lines 26 and 33\); YAML would silently keep only the second",
        ),
        (
            DEBUG_TEXT.replace("  lr: 1.0e-3\n", "  lr: 1.0e-3\n  lr: 5.0e-4\n"),
            r"'lr' is written twice .*lines 28 and 29",
        ),
        (
            DEBUG_TEXT.replace("  config_overrides:\n", "  config_overrides:\n    bomb:\n" + bomb()),
            rf"anchors and aliases expand to more than {MAX_NODES:,} values",
        ),
        (
            DEBUG_TEXT.replace("  config_overrides:\n", "  config_overrides:\n    loop: &l [*l]\n"),
            r"an alias at line 9 refers to a value that contains it \(a loop\)",
        ),
        ("model:\n  config_overrides:\n    a: " + "[" * 3000 + "]" * 3000 + "\n", r"nested too deeply to read"),
        (DEBUG_TEXT.encode() + "# caf\xe9\n".encode("latin-1"), r"not UTF-8 text \(byte 0xe9 on line 33\); save it as"),
        (DEBUG_TEXT.encode("utf-16"), r"not UTF-8 text \(byte 0xff on line 1\)"),
        (bytes(range(256)), r"not UTF-8 text"),
    ],
    ids=["section twice", "key twice", "alias bomb", "alias loop", "deep nesting", "latin-1", "utf-16", "binary"],
)
def test_yaml_that_would_lose_or_multiply_values_is_one_error(text, message, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.monotonic()
    with pytest.raises(RecipeError, match=message):
        load_config([f"recipe={recipe}"])
    assert time.monotonic() - start < 30  # the bomb is refused, not expanded


def test_yaml_that_is_fine_stays_fine(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(
        b"\xef\xbb\xbf"
        + DEBUG_TEXT.replace(  # a byte-order mark; a merge key overridden on purpose
            "  config_overrides:\n", "  config_overrides:\n    <<: {hidden_size: 32, num_hidden_layers: 1}\n"
        ).encode()
    )
    cfg = load_config([f"recipe={recipe}"])
    assert cfg.model.config_overrides["hidden_size"] == 64 and cfg.model.config_overrides["num_hidden_layers"] == 2
    assert load_config([f"recipe={DEBUG}", "data.source=a:b"]).data.source == "a:b"  # not YAML: the text itself


def test_override_values_get_the_same_yaml_rules():
    with pytest.raises(RecipeError, match=r"command line: model.config_overrides: 'a' is written twice"):
        load_config([f"recipe={DEBUG}", "model.config_overrides={a: 1, a: 2}"])
    levels = ["a: &a [x,x,x,x,x,x,x,x,x]"] + [
        f"{chr(98 + k)}: &{chr(98 + k)} [" + ",".join([f"*{chr(97 + k)}"] * 9) + "]" for k in range(6)
    ]
    with pytest.raises(RecipeError, match=r"command line: model.config_overrides: its anchors and aliases expand"):
        load_config([f"recipe={DEBUG}", "model.config_overrides={" + ", ".join(levels) + "}"])


# ---- through the commands: one line, exit 2, nothing written ----


BOMB_RECIPE = DEBUG_TEXT.replace("  config_overrides:\n", "  config_overrides:\n    bomb:\n" + bomb())
CLI_CASES = [
    ("lr NaN", lambda t: ["optim.lr=nan"], r"^error: optim\.lr=nan is not a number; it must be positive$"),
    ("lr multiplier NaN", lambda t: ["optim.lr_multipliers={model: .nan}"], r"optim\.lr_multipliers\.model=nan"),
    ("seed -1", lambda t: ["train.seed=-1"], r"train\.seed=-1 must be in \[0, 4294967295\]"),
    ("section twice", lambda t: [f"recipe={write(t, DEBUG_TEXT + 'optim: {name: sgd}')}"], r"'optim' is written twice"),
    ("not UTF-8", lambda t: [f"recipe={write(t, DEBUG_TEXT.encode('utf-16'))}"], r"not UTF-8 text"),
    ("alias bomb", lambda t: [f"recipe={write(t, BOMB_RECIPE)}"], r"expand to more than"),
    (
        "argument not UTF-8",
        lambda t: [os.fsdecode(b"optim.name=adam\xff")],
        r"optim\.name='adam\\udcff' is not one of adamw, sgd, lamb, lars, adamw_8bit, paged_adamw_8bit, paged_adamw; "
        r"did you mean 'adamw'\?",
    ),
]
if not torch.cuda.is_available():  # refused before the model loads: Liger's kernels are triton GPU kernels
    CLI_CASES.append(
        (
            "liger on a CPU",
            lambda t: ["model.liger_kernels=true"],
            r"^error: model\.liger_kernels=true needs a CUDA GPU",
        )
    )


def write(folder: Path, text) -> Path:
    path = folder / "r.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("name, extra, message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_train_says_it_in_one_line_exit_2_and_writes_nothing(name, extra, message, tmp_path, capfd):
    out = tmp_path / "out"
    args = extra(tmp_path)
    base = [] if any(a.startswith("recipe=") for a in args) else [f"recipe={DEBUG}"]
    assert_one_error(call(capfd, [*base, *args, f"train.output_dir={out}"]), message, out)


@pytest.mark.parametrize(
    "tool, args, message",
    [
        ("finetune.verify", ["verify.tolerance=nan"], r"^error: verify\.tolerance=nan must be positive$"),
        ("finetune.verify", ["optim.lr=inf"], r"optim\.lr=inf is not finite"),
        ("finetune.plan", ["plan.headroom=nan"], r"plan\.headroom"),
        ("finetune.plan", ["train.max_grad_norm=nan"], r"train\.max_grad_norm=nan is not a number"),
    ],
)
def test_plan_and_verify_share_the_boundary(tool, args, message, capfd):
    assert_one_error(call(capfd, [f"recipe={DEBUG}", *args], tool=tool), message)


def test_a_bug_keeps_its_traceback_and_exits_70(capfd, monkeypatch):
    import finetune.tools.train

    def broken(argv):
        raise KeyError("a bug")

    monkeypatch.setattr(finetune.tools.train, "load_config", broken)
    result = call(capfd, [f"recipe={DEBUG}"])
    assert result.returncode == 70, result.stderr
    assert "Traceback" in result.stderr and "KeyError: 'a bug'" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("internal error (KeyError): a bug in finetune")
    assert not any(line.startswith("error:") for line in result.stderr.splitlines())


def test_the_error_line_starts_a_line_of_its_own_after_a_progress_bar(monkeypatch):
    from tqdm import tqdm

    from finetune.tools import boundary

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    bar = tqdm(total=10, file=stream)
    bar.update(3)  # the bar holds the line: no newline after it yet

    def fails() -> int:
        raise RecipeError("the data broke")

    assert boundary.run_command(fails) == 2
    lines = stream.getvalue().replace("\r", "\n").splitlines()
    assert lines[-1] == "error: the data broke" and sum(line.startswith("error:") for line in lines) == 1
    assert bar.disable or bar not in getattr(tqdm, "_instances", ())  # closed: not drawn again below the error


def test_a_dataloader_worker_error_is_its_own_line_not_the_worker_traceback():
    from finetune.tools.boundary import _own_line

    wrapped = (
        "Caught RecipeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in rows\nfinetune.recipe.schema.RecipeError: d.jsonl line 7: not valid JSON '
        "(Expecting value at column 1) (data.on_bad_row=skip skips such rows)\n"
    )
    assert _own_line(wrapped) == (
        "d.jsonl line 7: not valid JSON (Expecting value at column 1) (data.on_bad_row=skip skips such rows)"
    )
    assert _own_line("plain: message") == "plain: message"


# ---- model.lora.* keys imply LoRA ----

LORA_OFF = r"given but model\.lora\.enabled is false, so the full model would train; set model\.lora\.enabled=true"


@pytest.mark.parametrize(
    "argv, named",
    [
        (["model.lora.r=16"], "model.lora.r=16"),
        (["model.lora.target_modules=all-linear"], "model.lora.target_modules=all-linear"),
        (["model.lora.r=8"], "model.lora.r=8"),  # the default, given: still meant LoRA
        (
            ["model.lora.r=16", "model.lora.target_modules=all-linear"],
            "model.lora.r=16, model.lora.target_modules=all-linear",
        ),
        (["model.lora={alpha: 32}"], "model.lora.alpha=32"),
        (["model.lora.merge=true"], "model.lora.merge=true"),
        (["model.lora.enabled=false", "model.lora.dropout=0.1"], "model.lora.dropout=0.1"),
        (["model.lora.r=4", "model.lora.enabled=false"], "model.lora.r=4"),  # the command line's own keys count
    ],
)
def test_a_lora_key_without_lora_enabled_is_one_error_naming_model_lora_enabled(argv, named):
    with pytest.raises(RecipeError) as error:
        load_config([f"recipe={DEBUG}", *argv])
    message = str(error.value)
    assert message.startswith(named) and re.search(LORA_OFF, message) and "\n" not in message, message
    removed = ", ".join(part.split("=")[0] for part in named.split(", "))
    assert message.endswith(f"to train a LoRA adapter, or remove {removed}"), message


@pytest.mark.parametrize(
    "argv", [["model.lora.r=16"], ["model.lora.target_modules=all-linear"], ["model.lora.merge=true"], []]
)
def test_lora_keys_with_lora_enabled_are_accepted(argv):
    cfg = load_config([f"recipe={DEBUG}", "model.lora.enabled=true", *argv])
    assert cfg.model.lora.enabled
    cfg = load_config([f"recipe={DEBUG}", *argv, "model.lora.enabled=true"])  # in either order
    assert cfg.model.lora.enabled
    assert not load_config([f"recipe={DEBUG}", "model.lora.enabled=false"]).model.lora.enabled


def lora_recipe(tmp_path, lora: str) -> str:
    """`recipe=` recipes/debug.yaml with a `lora:` section of the model's."""
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(DEBUG_TEXT.replace("  from_config: true\n", "  from_config: true\n  lora:\n" + lora))
    return f"recipe={recipe}"


def test_a_lora_key_in_the_recipe_file_needs_lora_enabled_there_too(tmp_path):
    with pytest.raises(RecipeError, match=r"^model\.lora\.r=16, model\.lora\.target_modules=all-linear " + LORA_OFF):
        load_config([lora_recipe(tmp_path, "    r: 16\n    target_modules: all-linear\n")])
    with pytest.raises(RecipeError, match=r"^model\.lora\.r=16 " + LORA_OFF):  # enabled: false beside it
        load_config([lora_recipe(tmp_path, "    enabled: false\n    r: 16\n")])
    with pytest.raises(RecipeError, match=r"^model\.lora\.alpha=16 " + LORA_OFF):  # alpha's default, written
        load_config([lora_recipe(tmp_path, "    alpha: 16\n")])
    recipe = lora_recipe(tmp_path, "    enabled: true\n    r: 16\n    target_modules: all-linear\n")
    cfg = load_config([recipe])
    assert cfg.model.lora.enabled and cfg.model.lora.r == 16 and cfg.model.lora.target_modules == "all-linear"
    # a LoRA recipe trained in full on purpose: model.lora.enabled=false on the command line turns off its keys
    assert not load_config([recipe, "model.lora.enabled=false"]).model.lora.enabled
    with pytest.raises(RecipeError, match=r"^model\.lora\.r=4 " + LORA_OFF):
        load_config([recipe, "model.lora.enabled=false", "model.lora.r=4"])


@pytest.mark.subprocess
@pytest.mark.distributed
def test_the_main_process_prints_the_error_when_another_rank_meets_it_first():
    """The launcher stops every rank once one exits: the main process, 3 s later to the same error, still prints it."""
    with turn_at_the_cores():
        result = subprocess.run(
            [*TWO_RANKS, "tests/workers/error_worker.py", "3"],
            cwd=ROOT,
            env={**ENV, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ON_PATH},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == ["error: the recipe is wrong"]


def test_a_rank_that_meets_an_error_alone_says_so_after_the_main_process_had_its_turn(monkeypatch):
    from finetune.tools import boundary

    stream, waited = io.StringIO(), []
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(boundary.time, "sleep", waited.append)

    def fails() -> int:
        raise RecipeError("this rank's data is wrong")

    assert boundary.run_command(fails) == 2
    assert waited == [boundary.MAIN_PROCESS_FIRST_S]
    assert stream.getvalue().splitlines() == ["error: rank 1: this rank's data is wrong"]
