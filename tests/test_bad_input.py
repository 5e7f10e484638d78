"""Bad input through the CLI, as users meet it: one `error:` line naming the file, row or key and what to do, exit
code 2, no traceback, and nothing half-written in train.output_dir.

Each case is (what is wrong, how to set it up, the message a user sees). Rows dropped by design are not errors: a
row without a supervised token is counted and dropped, so the case here is a file where no row has one.
"""

import contextlib
import re
import resource
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.data_files import chat, write_jsonl
from tests.launch import call

BASE = [
    "recipe=recipes/debug.yaml",
    "data.limit=16",
    "data.max_length=64",
    "train.max_steps=2",
    "log.wandb_mode=disabled",
]


def image_rows(tmp: Path, image: str) -> Path:
    (tmp / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a PNG")
    row = {
        "image": image,
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
            {"role": "assistant", "content": "A square."},
        ],
    }
    return write_jsonl(tmp / "images.jsonl", [row])


def other_model_checkpoint(tmp: Path) -> Path:
    folder = tmp / "elsewhere" / "checkpoint-7"
    folder.mkdir(parents=True)
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4)}, str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text("{}")
    (folder / "finetune_state.json").write_text("{}")
    return folder


def adapter_checkpoint(tmp: Path) -> Path:
    folder = tmp / "elsewhere" / "checkpoint-5"
    folder.mkdir(parents=True)
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
        str(folder / "adapter_model.safetensors"),
    )
    (folder / "trainer_state.json").write_text("{}")
    (folder / "finetune_state.json").write_text("{}")
    return folder


@contextlib.contextmanager
def file_size_limit(limit: int | None):
    """`ulimit -f` for this process while the command runs (the soft limit: the test raises it back after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# (id, argv after BASE given the tmp folder, extra environment, the error line a user sees)
CASES = [
    (
        "unknown key",
        lambda t: ["train.max_step=3"],
        {},
        r"^error: command line: unknown key 'train\.max_step'; did you mean 'train\.max_steps'\?$",
    ),
    (
        "wrong type",
        lambda t: ["train.max_steps=many"],
        {},
        r"^error: command line: train\.max_steps='many' is not a valid integer; fix the value$",
    ),
    (
        "value not among the choices",
        lambda t: ["data.batching=pack"],
        {},
        r"^error: data\.batching='pack' is not one of padded, length_grouped, token_budget, packed; did you mean "
        r"'packed'\?$",
    ),
    (
        "missing recipe",
        lambda t: ["recipe=recipes/nope.yaml"],
        {},
        r"^error: recipe file 'recipes/nope\.yaml' not found; pass recipe=PATH to an existing YAML file, or a "
        r"built-in recipe: bench, debug, qlora, quickstart, vlm, vlm_qwen, vlm_seed$",
    ),
    (
        "recipe that is not YAML",
        lambda t: [f"recipe={write_jsonl(t / 'r.yaml', ['model: [unclosed'])}"],
        {},
        r"^error: \S+r\.yaml: not valid YAML \(.+\); fix the file$",
    ),
    (
        "missing data file",
        lambda t: [f"data.source={t / 'nope.jsonl'}"],
        {},
        r"^error: data\.source=\S+nope\.jsonl: no such file or folder; check the path \(relative to \S+\), or give a "
        r"hub dataset id or stdlib_docs$",
    ),
    (
        "malformed JSON line",
        lambda t: [f"data.source={write_jsonl(t / 'd.jsonl', [chat('a', 'b'), '{oops'])}"],
        {},
        r"^error: \S+d\.jsonl line 2: not valid JSON \(.+\) \(data\.on_bad_row=skip skips such rows\)$",
    ),
    (
        "empty text",
        lambda t: [f"data.source={write_jsonl(t / 'd.jsonl', [{'text': 'fine'}, {'text': ' '}])}"],
        {},
        r"^error: \S+d\.jsonl line 2: text is empty \(data\.on_bad_row=skip skips such rows\)$",
    ),
    (
        "no row with a supervised token",
        lambda t: [f"data.source={write_jsonl(t / 'd.jsonl', [chat('only a question'), chat('another')])}"],
        {},
        r"^error: data\.source=\S+d\.jsonl: no rows left \(.*2 dropped without targets.*\)$",
    ),
    (
        "over-length row",
        lambda t: ["data.truncation=error", "data.max_length=16"],
        {},
        r"^error: \S+stdlib_docs\S*\.jsonl line 1: \d+ tokens, longer than data\.max_length=16; raise "
        r"data\.max_length or set data\.truncation=right \(cut\) or drop$",
    ),
    (
        "missing image",
        lambda t: [
            "recipe=recipes/vlm.yaml",
            f"data.source={image_rows(t, 'gone.png')}",
            "eval.fraction=0",
            "eval.every_steps=0",
        ],
        {},
        r"^error: \S+images\.jsonl line 1: image 1 of 1: image \S+gone\.png not found \(data\.on_bad_row=skip",
    ),
    (
        "corrupt image",
        lambda t: [
            "recipe=recipes/vlm.yaml",
            f"data.source={image_rows(t, 'bad.png')}",
            "eval.fraction=0",
            "eval.every_steps=0",
        ],
        {},
        r"^error: \S+images\.jsonl line 1: image 1 of 1: image \S+bad\.png cannot be read \(.+\) \(data\.on_bad_row",
    ),
    (
        "fp16 recipe under a bf16 accelerate config",
        lambda t: ["train.precision=fp16"],
        {"ACCELERATE_MIXED_PRECISION": "bf16"},
        r"^error: accelerate launch runs with mixed_precision=bf16 but the recipe has train\.precision=fp16; pass "
        r"train\.precision=bf16, or remove mixed_precision",
    ),
    (
        "global batch not divisible",
        lambda t: ["train.global_batch_size=10"],
        {},
        r"^error: train\.global_batch_size=10 is not divisible by train\.micro_batch_size=4 × 1 rank = 4; set "
        r"train\.global_batch_size=8 or train\.global_batch_size=12 \(a multiple of 4\)$",
    ),
    (
        "unwritable output directory",
        lambda t: [f"train.output_dir={write_jsonl(t / 'a-file', [])}/out"],
        {},
        r"^error: train\.output_dir=\S+a-file/out: cannot write there \(Not a directory\); choose a writable folder$",
    ),
    (
        "output directory full while saving",
        lambda t: ["train.save_steps=1"],
        {"limit": 2 * 2**20},
        r"^error: train\.output_dir=\S+: writing checkpoint-1 failed \(File too large\); a file grew past this "
        r"process's file size limit \(ulimit -f\); raise it \(ulimit -f unlimited\) \(nothing half-written was left "
        r"there\)$",
    ),
    (
        "output directory full at the final save",
        lambda t: [],
        {"limit": 2 * 2**20},
        r"^error: train\.output_dir=\S+: writing the final model failed \(File too large\); a file grew past this "
        r"process's file size limit \(ulimit -f\); raise it \(ulimit -f unlimited\) \(nothing half-written was left "
        r"there\)$",
    ),
    (
        "checkpoint of another model",
        lambda t: [f"train.resume_from={other_model_checkpoint(t)}"],
        {},
        r"^error: train\.resume_from: \S+checkpoint-7/model\.safetensors is from a different model "
        r"\(model\.embed_tokens\.weight has shape \[10, 4\] there but \[49152, 64\] in this model\); resume with the "
        r"recipe that wrote it, or start fresh in another train\.output_dir$",
    ),
    (
        "LoRA checkpoint for a full fine-tune",
        lambda t: [f"train.resume_from={adapter_checkpoint(t)}"],
        {},
        r"^error: train\.resume_from: \S+checkpoint-5 holds a LoRA adapter checkpoint but this recipe trains a full "
        r"model; set model\.lora\.enabled as when it was written, or start fresh in another train\.output_dir$",
    ),
    (
        "resume from a folder that is not there",
        lambda t: [f"train.resume_from={t / 'checkpoint-3'}"],
        {},
        r"^error: train\.resume_from=\S+checkpoint-3: no such checkpoint folder; give a checkpoint-N folder or auto$",
    ),
]


@pytest.mark.parametrize("name, extra, env, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_exit_2_and_nothing_half_written(name, extra, env, message, tmp_path, capfd):
    out = tmp_path / "out"
    env = dict(env)
    limit = env.pop("limit", None)
    extra = extra(tmp_path)
    own_recipe = any(a.startswith("recipe=") for a in extra)
    argv = [a for a in BASE if not (own_recipe and a.startswith("recipe="))] + [f"train.output_dir={out}", *extra]
    with file_size_limit(limit):
        result = call(capfd, argv, **env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-4000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    assert re.search(message, errors[0]), errors[0]
    written = [p for p in out.rglob("*") if p.is_file()] if out.is_dir() else []
    assert written == [], f"left in the output directory: {written}"


def test_space_check_on_a_rank_whose_output_dir_is_not_made_yet(tmp_path, monkeypatch):
    """Rank 0 alone probes (and removes again) a new train.output_dir; other ranks check space on its nearest parent."""
    from finetune.recipe import RecipeError
    from finetune.training import lifecycle

    model = torch.nn.Linear(256, 256)  # 257 KiB of weights, 514 KiB of AdamW state
    lifecycle.check_space(str(tmp_path / "not" / "yet"), model)  # no error: the folder is not there
    usage = type("Usage", (), {"free": 100 * 1024})
    monkeypatch.setattr(lifecycle.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(RecipeError, match=r"train\.output_dir=\S+/not/yet: 0\.00 GiB free, a checkpoint needs about"):
        lifecycle.check_space(str(tmp_path / "not" / "yet"), model)


def test_an_uncached_hub_id_with_the_hub_unreachable_is_one_error_at_once(monkeypatch):
    """transformers would retry an unreachable hub for about a minute and a half before its error."""
    import time

    from huggingface_hub import constants

    from finetune.model.loading import check_hub_id
    from finetune.recipe import RecipeError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    started = time.perf_counter()
    with pytest.raises(RecipeError, match=r"^model.name_or_path=someone/never-cached: the Hugging Face Hub "):
        check_hub_id("someone/never-cached")
    assert time.perf_counter() - started < 10
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline mode reads the cache: transformers says
    check_hub_id("someone/never-cached")
