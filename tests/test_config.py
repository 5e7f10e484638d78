"""Recipes: schema, overrides, and one clear line with exit code 2 for every mistake, before anything is written."""

import subprocess
import sys
from pathlib import Path

import pytest

from finetune.recipe import RecipeError, accumulation_steps, load_config
from tests.launch import call

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "recipes" / "debug.yaml")
DEBUG_TEXT = Path(DEBUG).read_text()


def test_recipe_then_overrides_in_order():
    cfg = load_config([f"recipe={DEBUG}", "optim.lr=1e-5", "train.max_steps=7", "model.freeze=[model.embed_tokens]"])
    assert cfg.optim.lr == 1e-5 and cfg.train.max_steps == 7
    assert cfg.model.freeze == ["model.embed_tokens"]
    assert cfg.model.config_overrides["hidden_size"] == 64  # from the YAML
    assert cfg.recipe == DEBUG


def test_every_shipped_recipe_loads():
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        load_config([f"recipe={recipe}"])


def test_built_in_recipes_by_name_and_a_path_that_exists_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here: the names reach the repository's recipes/ folder
    assert Path(load_config(["recipe=vlm.yaml"]).recipe) == ROOT / "recipes" / "vlm.yaml"
    assert Path(load_config(["recipe=quickstart"]).recipe) == ROOT / "recipes" / "quickstart.yaml"
    Path("quickstart.yaml").write_text("model:\n  name_or_path: somewhere\ntrain:\n  max_steps: 7\n")
    own = load_config(["recipe=quickstart.yaml"])
    assert own.recipe == "quickstart.yaml" and own.train.max_steps == 7 and own.model.name_or_path == "somewhere"
    with pytest.raises(RecipeError, match=r"^recipe file 'nope' not found"):
        load_config(["recipe=nope"])


def test_accumulation_is_derived_from_the_global_batch():
    cfg = load_config([f"recipe={DEBUG}", "train.global_batch_size=96", "train.micro_batch_size=4"])
    assert accumulation_steps(cfg, ranks=1) == 24
    assert accumulation_steps(cfg, ranks=8) == 3
    with pytest.raises(
        RecipeError,
        match=r"train.global_batch_size=96 is not divisible by "
        r"train.micro_batch_size=5 × 8 ranks = 40",
    ):
        cfg.train.micro_batch_size = 5
        accumulation_steps(cfg, ranks=8)


def test_token_budgets_state_the_global_batch_in_tokens():
    base = [f"recipe={DEBUG}", "data.batching=token_budget", "data.max_tokens_per_micro_batch=512"]
    cfg = load_config([*base, "train.global_batch_tokens=4096"])
    assert accumulation_steps(cfg, ranks=2) == 4
    with pytest.raises(RecipeError, match="set train.global_batch_tokens"):
        load_config(base)
    with pytest.raises(RecipeError, match="train.global_batch_tokens=5000 is not divisible"):
        load_config([*base, "train.global_batch_tokens=5000"])
    with pytest.raises(RecipeError, match="below data.max_length"):
        load_config([*base, "train.global_batch_tokens=4096", "data.max_length=1024"])


BAD = [
    (["recipe=recipes/nope.yaml"], "recipe file 'recipes/nope.yaml' not found"),
    (["recipe=quikstart"], "or a built-in recipe: bench, debug, qlora, quickstart, vlm, vlm_qwen, vlm_seed"),
    ([f"recipe={DEBUG}", "train.micro_bach_size=2"], "did you mean 'train.micro_batch_size'"),
    ([f"recipe={DEBUG}", "optim.lr=fast"], "optim.lr='fast' is not a valid number"),
    (
        [f"recipe={DEBUG}", "train.global_batch_size=10", "train.micro_batch_size=4"],
        "train.global_batch_size=10 is not divisible by train.micro_batch_size=4 × 1 rank = 4",
    ),
    ([f"recipe={DEBUG}", "train.precision=bf15"], "did you mean 'bf16'"),
    ([f"recipe={DEBUG}", "lr=1e-5"], "unknown key 'lr'; in a recipe this is optim.lr"),
    ([f"recipe={DEBUG}", "train.lerning_rate=1e-5"], "unknown key 'train.lerning_rate'; in a recipe this is optim.lr"),
    # names from TRL, axolotl, LLaMA-Factory and TrainingArguments: where the setting lives, or what is done instead
    (
        [f"recipe={DEBUG}", "train.warmup_steps=3"],
        "unknown key 'train.warmup_steps'; in a recipe this is schedule.warm",
    ),
    ([f"recipe={DEBUG}", "data.cutoff_len=512"], "unknown key 'data.cutoff_len'; in a recipe this is data.max_length"),
    ([f"recipe={DEBUG}", "train.push_to_hub=true"], "a run does not upload; upload train.output_dir afterwards"),
    ([f"recipe={DEBUG}", "train.deepspeed=ds.json"], "DeepSpeed is chosen at launch: accelerate launch --config_file"),
    # a far guess misleads (push_to_hub was answered with train.epochs): none is offered
    ([f"recipe={DEBUG}", "train.quux=1"], "unknown key 'train.quux'; --help lists the keys"),
    (["train.max_steps=3"], "model.name_or_path must be set"),
    ([f"recipe={DEBUG}", "optim.lr_scaling=linear"], "needs optim.base_batch_size"),
    ([f"recipe={DEBUG}", "max_steps"], "is not key=value"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_recipe_is_one_line_exit_2_and_writes_nothing(argv, message, tmp_path, capfd):
    out = tmp_path / "out"
    result = call(capfd, [*argv, f"train.output_dir={out}"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0]
    assert not out.exists()


def test_yaml_is_safe_loaded(tmp_path):
    recipe = tmp_path / "evil.yaml"
    recipe.write_text("model:\n  name_or_path: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_config([f"recipe={recipe}"])
    recipe.write_text(
        "model:\n  name_or_path: !!python/object/apply:pathlib.Path ['x']\n"
    )  # OmegaConf's loader takes it
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_config([f"recipe={recipe}"])


# ---- numbers as YAML 1.2 writes them: `1e-5` without a dot is a float (PyYAML's YAML 1.1 left it text) ----

EXPONENTS = {"rms_norm_eps": ("1e-5", 1e-5), "rope_theta": ("1e6", 1e6), "initializer_range": ("-2.5E+3", -2500.0)}


def test_exponent_numbers_are_floats_in_a_recipe_file_and_on_the_command_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    lines = "".join(f"    {key}: {text}\n" for key, (text, _) in EXPONENTS.items())
    recipe.write_text(DEBUG_TEXT.replace("  config_overrides:\n", "  config_overrides:\n" + lines))
    from_file = load_config([f"recipe={recipe}"]).model.config_overrides
    given = [f"model.config_overrides.{key}={text}" for key, (text, _) in EXPONENTS.items()]
    from_argv = load_config([f"recipe={DEBUG}", *given]).model.config_overrides
    in_a_map = load_config([f"recipe={DEBUG}", "model.config_overrides={a: 1e-5, b: [1e6, -2.5E+3]}"])
    for overrides in (from_file, from_argv):
        assert {key: overrides[key] for key in EXPONENTS} == {key: value for key, (_, value) in EXPONENTS.items()}
        assert all(type(overrides[key]) is float for key in EXPONENTS), overrides
    assert in_a_map.model.config_overrides["a"] == 1e-5 and in_a_map.model.config_overrides["b"] == [1e6, -2500.0]
    assert type(in_a_map.model.config_overrides["b"][0]) is float
    assert load_config([f"recipe={DEBUG}", "optim.lr=2e-5", "optim.lr_multipliers={lm_head: 1e1}"]).optim.lr == 2e-5
    assert load_config([f"recipe={DEBUG}", "log.run_name=2024-05-01"]).log.run_name == "2024-05-01"  # a date: text
    assert load_config([f"recipe={DEBUG}", "model.config_overrides.tag='1e5'"]).model.config_overrides["tag"] == "1e5"


def test_an_exponent_in_config_overrides_reaches_the_model_config_and_the_built_model():
    from finetune.model import loading

    cfg = load_config([f"recipe={DEBUG}", "model.config_overrides.rms_norm_eps=1e-5", "model.dtype=float32"])
    folder = loading.model_folder(cfg.model)
    config = loading.model_config(cfg.model, folder)  # what the run checks before any weight loads
    assert config.rms_norm_eps == 1e-5 and type(config.rms_norm_eps) is float
    model = loading.load_model(cfg.model, folder)
    assert model.config.rms_norm_eps == 1e-5 and model.model.norm.variance_epsilon == 1e-5
    assert model.config.hidden_size == 64  # the recipe's own overrides still apply


def test_exponent_numbers_keep_the_refusals(tmp_path):
    with pytest.raises(RecipeError, match=r"model.config_overrides.rms_norm_eps=inf is not a finite number"):
        load_config([f"recipe={DEBUG}", "model.config_overrides.rms_norm_eps=1e400"])  # overflows to inf: refused
    with pytest.raises(RecipeError, match=r"optim.lr=inf is not finite"):
        load_config([f"recipe={DEBUG}", "optim.lr=1e999"])
    with pytest.raises(RecipeError, match=r"model.config_overrides: 'a' is written twice"):
        load_config([f"recipe={DEBUG}", "model.config_overrides={a: 1e-5, a: 2e-5}"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        DEBUG_TEXT.replace("  config_overrides:\n", "  config_overrides:\n    eps: 1e-5\n    eps: 1e-6\n")
    )
    with pytest.raises(RecipeError, match=r"'eps' is written twice in one mapping \(lines 9 and 10\)"):
        load_config([f"recipe={recipe}"])
    recipe.write_text(DEBUG_TEXT.replace("  config_overrides:\n", "  config_overrides:\n    eps: -.inf\n"))
    with pytest.raises(RecipeError, match=r"model.config_overrides.eps=-inf is not a finite number"):
        load_config([f"recipe={recipe}"])
    with pytest.raises(RecipeError, match=r"train.max_steps=1000.0 is not a valid integer"):
        load_config([f"recipe={DEBUG}", "train.max_steps=1e3"])  # a float where an integer is asked: refused


@pytest.mark.subprocess
def test_fp16_on_a_machine_without_gpu_is_an_error_not_silent_fp32(tmp_path):
    import torch

    if torch.cuda.is_available():  # on a GPU, fp16 is real (GradScaler): the CPU-only error does not apply
        return
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "finetune/train.py", f"recipe={DEBUG}", "train.precision=fp16", f"train.output_dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: train.precision=fp16 needs a GPU; on a CPU use train.precision=bf16 or train.precision=fp32"
    ]
    assert not out.exists()
