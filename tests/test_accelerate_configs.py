"""accelerate_configs/*.yaml and finetune.training.distributed.check_launch: what `accelerate launch` hands each rank,
read with accelerate's own launch code (no process started), against the recipe. In-process and fast, except the last
test, which launches 2 CPU ranks to see the error arrive as one line."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from finetune.env import world_size
from finetune.recipe import RecipeError, load_config, resolve_plan
from finetune.training.distributed import accelerator_config, check_launch
from tests.launch import turn_at_the_cores

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
DEBUG = [f"recipe={ROOT / 'recipes' / 'debug.yaml'}"]  # micro 4, global 8
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))


def launch_check(cfg, env):
    """What finetune/tools/train.py does before torch loads: the plan for the launch's ranks, then the launch check."""
    return check_launch(cfg.train, cfg.optim, cfg.data, resolve_plan(cfg, world_size(env)), env)


def launch_env(name: str, num_processes: int, *flags: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file accelerate_configs/NAME.yaml` gives every rank."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    argv = ["--config_file", str(CONFIGS / f"{name}.yaml"), "--num_processes", str(num_processes), *flags, "x.py"]
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:  # as accelerate's launch_command does before deepspeed_launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        env = prepare_deepspeed_cmd_env(args)[1]
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    return {**env, "WORLD_SIZE": str(num_processes)}  # torchrun adds WORLD_SIZE in each rank


@pytest.mark.parametrize("name,ranks", [("single_gpu", 1), ("ddp", 2), ("fsdp2", 2), ("zero2", 2), ("zero3", 2)])
def test_every_shipped_config_agrees_with_a_recipe_it_can_run(name, ranks):
    env = launch_env(name, ranks)
    assert env["ACCELERATE_MIXED_PRECISION"] == "no"  # precision comes from the recipe
    for precision in ("fp32", "bf16"):
        launch_check(load_config([*DEBUG, f"train.precision={precision}"]), env)


def test_fsdp2_config_shards_fully_and_checkpoints_sharded():
    env = launch_env("fsdp2", 2)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true"
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert env["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"


TRAINER_DS_METHODS = ("is_auto", "fill_match", "fill_only", "trainer_config_process")


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_deepspeed_batch_and_clipping_come_from_the_recipe(name, monkeypatch):
    """accelerate builds the DeepSpeed config with "auto" for every batch key and clipping; transformers then fills
    them from TrainingArguments: train_batch_size is the recipe's global batch."""
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_deepspeed

    for key, value in launch_env(name, 2).items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    ds = plugin.deepspeed_config
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        assert ds[key] == "auto", key
    assert "optimizer" not in ds and "scheduler" not in ds
    stage = 3 if name == "zero3" else 2
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)
    assert plugin.zero3_init_flag is (stage == 3)

    # transformers' own filling code (HfTrainerDeepSpeedConfig), with the TrainingArguments values build() derives
    # from a recipe on 2 ranks. Without DeepSpeed installed that class has no config base, so its methods are run
    # on accelerate's HfDeepSpeedConfig, which is its base when DeepSpeed is installed.
    trainer_config = hf_deepspeed.HfTrainerDeepSpeedConfig.__dict__
    filled_type = type("Filled", (HfDeepSpeedConfig,), {k: trainer_config[k] for k in TRAINER_DS_METHODS})
    cfg = load_config([*DEBUG, "train.global_batch_size=32", "train.max_grad_norm=0.7", "train.precision=bf16"])
    plugin.set_mixed_precision("bf16")  # as TrainingArguments does with the recipe's precision
    args = SimpleNamespace(
        world_size=2,
        per_device_train_batch_size=cfg.train.micro_batch_size,
        gradient_accumulation_steps=4,
        max_grad_norm=cfg.train.max_grad_norm,
        learning_rate=1e-3,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        save_on_each_node=False,
        fp16=False,
        bf16=True,
        fp16_full_eval=False,
        bf16_full_eval=False,
    )
    filled = filled_type(ds)
    filled.mismatches, filled._dtype = [], None
    filled.trainer_config_process(args)
    assert filled.mismatches == []
    assert filled.config["train_batch_size"] == cfg.train.global_batch_size == 32
    assert filled.config["train_micro_batch_size_per_gpu"] == 4 and filled.config["gradient_accumulation_steps"] == 4
    assert filled.config["gradient_clipping"] == 0.7 and filled.config["bf16"]["enabled"] is True


def test_mixed_precision_that_contradicts_the_recipe_says_which_to_change():
    env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    with pytest.raises(
        RecipeError,
        match=r"mixed_precision=bf16 but the recipe has train.precision=fp32; pass "
        r"train.precision=bf16, or remove mixed_precision",
    ):
        launch_check(load_config(DEBUG), env)
    with pytest.raises(RecipeError, match=r"mixed_precision=fp16 .* train.precision=bf16"):
        launch_check(load_config([*DEBUG, "train.precision=bf16"]), {"ACCELERATE_MIXED_PRECISION": "fp16"})
    launch_check(load_config([*DEBUG, "train.precision=bf16"]), env)  # agreeing is fine
    launch_check(load_config([*DEBUG, "train.precision=bf16"]), {"ACCELERATE_MIXED_PRECISION": "no"})  # default


def test_a_rank_count_that_does_not_divide_the_global_batch_names_the_numbers(monkeypatch):
    cfg = load_config(DEBUG)
    with pytest.raises(
        RecipeError,
        match=r"train.global_batch_size=8 is not divisible by train.micro_batch_size=4 "
        r"× 3 ranks = 12; set train.global_batch_size=12 \(a multiple of 12\)$",
    ):
        launch_check(cfg, {"WORLD_SIZE": "3"})
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun sets in every rank: load_config already refuses
    with pytest.raises(RecipeError, match=r"× 3 ranks = 12"):
        load_config(DEBUG)


def write_json(tmp_path, data) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_hard_coded_deepspeed_values_that_disagree_name_both_keys(tmp_path):
    cfg = load_config(DEBUG)  # 1 rank: micro 4 × accumulation 2 = 8
    ds = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW"},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, ds)}
    with pytest.raises(RecipeError) as error:
        launch_check(cfg, env)
    message = str(error.value)
    assert "DeepSpeed train_batch_size=16" in message and "train.global_batch_size=8" in message
    assert "DeepSpeed gradient_clipping=0.5" in message and "train.max_grad_norm=1.0" in message
    assert '"optimizer" section' in message and "optim.*" in message
    assert "DeepSpeed bf16.enabled=true" in message and "train.precision=fp32" in message
    assert "train_micro_batch_size_per_gpu" not in message  # 4 agrees with train.micro_batch_size
    assert "\n" not in message  # one line


def test_accumulation_from_the_accelerate_config_must_match_the_recipe(tmp_path):
    cfg = load_config([*DEBUG, "train.global_batch_size=32"])
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "WORLD_SIZE": "2"}
    with pytest.raises(
        RecipeError,
        match=r"DeepSpeed gradient_accumulation_steps=1 in the accelerate config "
        r"\(deepspeed_config\) disagrees with the recipe's 4 \(from "
        r"train.global_batch_size over 2 ranks",
    ):
        launch_check(cfg, env)
    launch_check(cfg, {**env, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"})
    auto = {
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3},
    }
    launch_check(
        cfg,
        {
            **env,
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "auto",
            "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, auto),
        },
    )


def test_a_missing_deepspeed_file_is_named():
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "nowhere/ds.json"}
    with pytest.raises(RecipeError, match=r"DeepSpeed config file 'nowhere/ds.json' .* not found"):
        launch_check(load_config(DEBUG), env)


def test_sync_each_batch_reaches_the_accelerator():
    from transformers import TrainingArguments

    cfg = load_config([*DEBUG, "train.sync_each_batch=true"])
    args = TrainingArguments(
        output_dir="unused", use_cpu=True, report_to=[], accelerator_config=accelerator_config(cfg.train)
    )
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}


@pytest.mark.subprocess  # the launcher's output and exit code are the behaviour: it stays a real launch
@pytest.mark.distributed
def test_the_launched_error_is_one_line_and_exit_code_2(tmp_path):
    """Through the real launcher: 2 CPU ranks, ddp.yaml, --mixed_precision bf16 against an fp32 recipe."""
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        str(CONFIGS / "ddp.yaml"),
        "--num_processes",
        "2",
        "--mixed_precision",
        "bf16",
        "finetune/train.py",
        *DEBUG,
        f"train.output_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    with turn_at_the_cores():
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: accelerate launch runs with mixed_precision=bf16 but the recipe has train.precision=fp32; pass "
        "train.precision=bf16, or remove mixed_precision from the accelerate config (and --mixed_precision from the "
        "command line) so the recipe decides"
    ]
    assert not (tmp_path / "run").exists()


def test_fsdp_checkpoints_stay_sharded_and_the_final_save_is_consolidated(monkeypatch):
    """Only the switch is tested here: gathering the weights needs Accelerate's FSDP, which needs a GPU."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from finetune.training import distributed

    assert distributed.callbacks() == []  # not under FSDP
    for key, value in launch_env("fsdp2", 2).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # from the launched environment, as Accelerator builds it
    assert plugin.fsdp_version == 2 and "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    monkeypatch.setattr(distributed, "_fsdp_plugin", lambda: plugin)
    [callback] = distributed.callbacks()
    callback.on_train_end(None, None, None)
    assert str(plugin.state_dict_type).endswith("FULL_STATE_DICT")


def test_a_planned_micro_batch_leaves_only_the_batch_keys_unchecked(tmp_path):
    """train.micro_batch_size=auto is chosen when training starts: batch keys cannot be compared before that."""
    cfg = load_config(DEBUG)
    cfg.train.micro_batch_size = "auto"
    ds = {"train_batch_size": 16, "gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": write_json(tmp_path, ds),
        "WORLD_SIZE": "3",
    }
    with pytest.raises(RecipeError) as error:
        launch_check(cfg, env)
    assert "gradient_clipping=0.5" in str(error.value) and "train_batch_size" not in str(error.value)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_layerwise_optimizers_are_refused_under_zero(name):
    env = launch_env("zero2", 2)
    with pytest.raises(RecipeError, match=rf"optim.name={name} computes a trust ratio per parameter tensor"):
        launch_check(load_config([*DEBUG, f"optim.name={name}"]), env)
    launch_check(load_config([*DEBUG, f"optim.name={name}"]), launch_env("ddp", 2))  # fine under DDP
