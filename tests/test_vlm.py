"""Vision-language fine-tuning: image rows and their labels, bad images, exactness with pixel inputs (float64 brute
force), the frozen tower, LoRA on the language model only, and recipes/vlm.yaml end to end."""

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import (
    DataCollatorForSeq2Seq,
    LlavaForConditionalGeneration,
    Trainer,
)

from finetune import TokenNormTrainer
from finetune.data import shapes_captions
from finetune.data.vision import VisionCollator, load_vision_dataset, open_image
from finetune.model.llava import IMAGE_TOKEN, llava_processor
from finetune.model.vlm import is_vlm, prepare_vlm
from finetune.recipe import DataConfig, ModelConfig, OptimConfig, RecipeError, load_config, resolve_plan
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import VOCAB, SnapshotCallback, sgd_args, tiny_llama, tiny_qwen_vl
from tests.data_files import write_jsonl
from tests.launch import call, forked_ranks
from tests.vlm_models import prepared, tiny_llava

EOT = "<|im_end|>"
TOKENS_PER_IMAGE = 4  # 32 px images, 16 px patches


def user(*parts):
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


def image_rows(folder: Path, extra=()) -> Path:
    """Two-image, image-less (two) and LLaVA-style `<image>\\n` rows, images as paths relative to the jsonl."""
    (folder / "img").mkdir(exist_ok=True)
    for k in range(3):
        shapes_captions.render(shapes_captions.scene(100 + k)).save(folder / "img" / f"{k}.png")
    rows = [
        {
            "images": ["img/0.png", "img/1.png"],
            "messages": [
                user(None, None, "Which image has more shapes?"),
                {"role": "assistant", "content": "The second one, with more shapes in more colours."},
            ],
        },
        {
            "messages": [
                {"role": "user", "content": "What is a circle?"},
                {"role": "assistant", "content": "A round shape."},
            ]
        },
        {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]},
        {
            "image": "img/2.png",
            "messages": [
                {"role": "user", "content": "<image>\nWhat is the background?"},
                {"role": "assistant", "content": "It is plain."},
            ],
        },
        *extra,
    ]
    return write_jsonl(folder / "rows.jsonl", rows)


def labelled(tokenizer, row) -> str:
    return tokenizer.decode([t for t in row["labels"] if t != -100])


# ---- data ----


def test_shapes_captions_are_deterministic_with_captions_of_10_to_100_tokens(processor):
    first, again = shapes_captions.rows(), shapes_captions.rows(8)
    assert [r["messages"] for r in first[:8]] == [r["messages"] for r in again]
    assert first[5]["images"][0].tobytes() == again[5]["images"][0].tobytes()
    lengths = [len(processor.tokenizer(r["messages"][1]["content"])["input_ids"]) for r in first]
    assert min(lengths) <= 12 and max(lengths) >= 90
    scene = shapes_captions.scene(3)
    caption = shapes_captions.caption(scene, "count")
    assert caption.startswith(f"There are {shapes_captions.NUMBERS[len(scene.shapes)]} shapes")
    image = shapes_captions.render(scene)  # the first shape's cell centre has its colour
    cx, cy = [int((c + 0.5) * image.width / 3) for c in (scene.shapes[0].cell % 3, scene.shapes[0].cell // 3)]
    assert image.getpixel((cx, cy)) == shapes_captions.COLOURS[scene.shapes[0].colour]


def test_shapes_rows_label_only_the_caption_never_image_tokens(processor):
    ds, report = load_vision_dataset(DataConfig(source="shapes_captions", limit=6), processor)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert report.rows_kept == 6 and report.format == "messages+images"
    for k, row in enumerate(ds):
        assert labelled(processor.tokenizer, row) == shapes_captions.row(k)["messages"][1]["content"] + EOT
        assert row["input_ids"].count(image_id) == TOKENS_PER_IMAGE and len(row["images"]) == 1
        first = next(i for i, t in enumerate(row["labels"]) if t != -100)
        assert image_id in row["input_ids"][:first]  # the image sits in the (masked) prompt
        assert processor.tokenizer.decode(row["input_ids"][:first]).endswith("<|im_start|>assistant\n")


def test_jsonl_rows_relative_images_placeholders_and_image_less_rows(processor, tmp_path):
    ds, report = load_vision_dataset(DataConfig(source=str(image_rows(tmp_path))), processor)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert report.rows_kept == 4
    assert [r["input_ids"].count(image_id) for r in ds] == [8, 0, 0, 4]
    assert [len(r["images"]) for r in ds] == [2, 0, 0, 1]
    assert labelled(processor.tokenizer, ds[3]) == "It is plain." + EOT
    collate = VisionCollator(DataCollatorForSeq2Seq(processor.tokenizer, label_pad_token_id=-100), processor)
    batch = collate([ds[k] for k in range(4)])
    assert batch["pixel_values"].shape == (3, 3, 32, 32)  # the three images, in row order
    assert int((batch["input_ids"] == image_id).sum()) == 3 * TOKENS_PER_IMAGE
    expected = processor.image_processor([open_image(tmp_path / "img" / "2.png")], return_tensors="pt")
    assert torch.equal(batch["pixel_values"][2], expected["pixel_values"][0])
    assert set(collate([ds[1], ds[2]])) == {"input_ids", "attention_mask", "labels"}  # no images: text only


def test_missing_or_corrupt_image_names_the_row_or_is_skipped_and_counted(processor, tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    bad = [
        {"image": "img/missing.png", "messages": [user(None, "Describe."), {"role": "assistant", "content": "X."}]},
        {"image": "img/bad.png", "messages": [user(None, "Describe."), {"role": "assistant", "content": "Y."}]},
    ]
    source = image_rows(tmp_path, extra=bad)
    with pytest.raises(RecipeError, match=r"rows\.jsonl line 5: image 1 of 1: image .*missing\.png not found"):
        load_vision_dataset(DataConfig(source=str(source)), processor)
    ds, report = load_vision_dataset(DataConfig(source=str(source), on_bad_row="skip"), processor)
    assert (report.rows_kept, report.bad_rows_skipped) == (4, 2)
    with pytest.raises(RecipeError, match=r"b\.jsonl line 1: image 1 of 1: image .*bad\.png cannot be read"):
        load_vision_dataset(DataConfig(source=str(write_jsonl(tmp_path / "b.jsonl", bad[1:]))), processor)


def test_placeholders_that_do_not_match_the_images_name_the_row(processor, tmp_path):
    rows = [
        {
            "image": "img/0.png",
            "messages": [{"role": "user", "content": "<image> and <image>?"}, {"role": "assistant", "content": "Two."}],
        }
    ]
    image_rows(tmp_path)
    with pytest.raises(RecipeError, match=r"m\.jsonl line 1: messages hold 2 image placeholder\(s\).* has 1 image"):
        load_vision_dataset(DataConfig(source=str(write_jsonl(tmp_path / "m.jsonl", rows))), processor)


def test_hf_image_dataset_from_parquet(processor, tmp_path):
    import datasets

    image = shapes_captions.render(shapes_captions.scene(7))
    table = datasets.Dataset.from_dict(
        {
            "images": [[image]],
            "messages": [[{"role": "user", "content": "Describe."}, {"role": "assistant", "content": "Shapes."}]],
        },
        features=datasets.Features(
            {
                "images": [datasets.Image()],
                "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            }
        ),
    )
    table.to_parquet(str(tmp_path / "train.parquet"))
    ds, _ = load_vision_dataset(DataConfig(source=str(tmp_path / "train.parquet")), processor)
    batch = VisionCollator(DataCollatorForSeq2Seq(processor.tokenizer), processor)([ds[0]])
    expected = processor.image_processor([image], return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"], expected)
    assert labelled(processor.tokenizer, ds[0]) == "Shapes." + EOT


def test_shapes_captions_with_a_text_model_is_a_recipe_error(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "text")
    cfg = load_config([f"model.name_or_path={tmp_path / 'text'}", "data.source=shapes_captions"])
    with pytest.raises(RecipeError, match="shapes_captions is an image set .* set model.vision_config"):
        is_vlm(cfg.model, cfg.data, resolve_plan(cfg, 1), str(tmp_path / "text"))


# ---- exactness with pixel inputs ----


class Recording:
    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __call__(self, rows):
        self.batches.append([dict(r) for r in rows])
        return self.inner(rows)


def check_every_step(initial, trainer, collator, accumulation, forward):
    snapshots = SnapshotCallback()
    trainer.add_callback(snapshots)
    trainer.train()
    windows = [sum(collator.batches[i : i + accumulation], []) for i in range(0, len(collator.batches), accumulation)]
    assert len(snapshots.snapshots) == len(windows) + 1
    errors = []
    for k, window in enumerate(windows):
        model = copy.deepcopy(initial)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(snapshots.snapshots[k][name])
        grads, _ = reference_gradient(model, window, forward)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        errors.append(relative_error(applied, grads))
    return errors, collator.batches


def test_llava_gradient_with_images_is_the_window_token_mean(processor, tmp_path):
    """Tower, projector and language model all train; one micro-batch has no image (the zero-weighted dummy runs)."""
    import datasets

    shapes, _ = load_vision_dataset(DataConfig(source="shapes_captions", limit=12), processor)
    short = sorted(range(12), key=lambda k: sum(t != -100 for t in shapes[k]["labels"]))[:4]  # a cheaper reference
    jsonl, _ = load_vision_dataset(DataConfig(source=str(image_rows(tmp_path))), processor)
    rows = datasets.concatenate_datasets([shapes.select(short[:2]), jsonl.select([1, 2, 0]), shapes.select(short[2:])])
    initial = prepared(processor)
    collator = Recording(
        VisionCollator(DataCollatorForSeq2Seq(processor.tokenizer, label_pad_token_id=-100), processor)
    )
    trainer = TokenNormTrainer(
        model=copy.deepcopy(initial),
        train_dataset=rows,
        data_collator=collator,
        args=sgd_args(tmp_path / "out", 2, 2, train_sampling_strategy="sequential"),
    )

    def forward(model, seq):
        pixels = {}
        if seq["images"]:
            images = [open_image(ref) for ref in seq["images"]]
            pixels["pixel_values"] = processor.image_processor(images, return_tensors="pt")["pixel_values"].double()
        return model(input_ids=torch.tensor([seq["input_ids"]]), **pixels).logits

    errors, batches = check_every_step(initial, trainer, collator, 2, forward)
    assert max(errors) <= 1e-5
    assert [sum(len(r["images"]) for r in b) for b in batches] == [2, 0, 3, 1]
    tower = [n for n, p in trainer.model.named_parameters() if "vision_tower" in n and p.requires_grad]
    assert tower and all(
        not torch.equal(p, initial.get_parameter(n)) for n, p in trainer.model.named_parameters() if n in tower
    )


def qwen_rows(n: int, seed: int) -> list[dict]:
    """Qwen2.5-VL rows: 0–2 images of a 4 × 4 patch grid (4 tokens after the 2 × 2 merge) after a prompt."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for k in range(n):
        images = 0 if k % 3 == 1 else rng.randint(1, 2)
        prompt = [rng.randrange(3, VOCAB - 4) for _ in range(rng.randint(1, 4))]
        prompt += [VOCAB - 3, *[VOCAB - 1] * 4] * images
        answer = [rng.randrange(3, VOCAB - 4) for _ in range(rng.randint(2, 20))]
        rows.append(
            {
                "input_ids": prompt + answer,
                "labels": [-100] * len(prompt) + answer,
                "pixel_values": torch.randn(16 * images, 1176, generator=gen),
                "image_grid_thw": [[1, 4, 4]] * images,
            }
        )
    return rows


def qwen_collate(rows):
    width = max(len(r["input_ids"]) for r in rows)

    def pad(seq, value):
        return list(seq) + [value] * (width - len(seq))

    batch = {
        "input_ids": torch.tensor([pad(r["input_ids"], 0) for r in rows]),
        "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
        "labels": torch.tensor([pad(r["labels"], -100) for r in rows]),
    }
    if any(r["image_grid_thw"] for r in rows):
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
        batch["image_grid_thw"] = torch.tensor([g for r in rows for g in r["image_grid_thw"]])
    return batch


@pytest.mark.parametrize("trainer_cls", [TokenNormTrainer, Trainer], ids=["TokenNormTrainer", "stock_Trainer"])
def test_qwen2_5_vl_without_loss_kwargs_is_exact_with_pixels(trainer_cls, tmp_path):
    initial = tiny_qwen_vl()
    assert initial.accepts_loss_kwargs is False
    collator = Recording(qwen_collate)
    trainer = trainer_cls(
        model=copy.deepcopy(initial),
        train_dataset=qwen_rows(10, seed=1),
        data_collator=collator,
        args=sgd_args(tmp_path, 3, 2),
    )

    def forward(model, seq):
        pixels = {}
        if seq["image_grid_thw"]:
            pixels = {
                "pixel_values": seq["pixel_values"].double(),
                "image_grid_thw": torch.tensor(seq["image_grid_thw"]),
            }
        return model(input_ids=torch.tensor([seq["input_ids"]]), **pixels).logits

    errors, batches = check_every_step(initial, trainer, collator, 2, forward)
    assert sum(len(r["image_grid_thw"]) for b in batches for r in b) > 0
    if trainer_cls is TokenNormTrainer:
        assert max(errors) <= 1e-5
    else:  # per-micro-batch means: the same check fails
        assert max(errors) > 1e-2


# ---- freezing, LoRA, LR groups ----


def test_frozen_tower_is_bit_identical_after_training_and_stores_no_activations(processor, tmp_path):
    rows, _ = load_vision_dataset(DataConfig(source="shapes_captions", limit=4), processor)
    model = prepared(processor, freeze=["vision_tower"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = sgd_args(tmp_path, 2, 1, max_steps=2)
    args.optim, args.learning_rate, args.weight_decay = "adamw_torch", 1e-2, 0.1
    TokenNormTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        data_collator=VisionCollator(DataCollatorForSeq2Seq(processor.tokenizer), processor),
    ).train()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == ("vision_tower" in name), name

    # enable_input_require_grads (used with PEFT + checkpointing) makes SigLIP's patch embeddings require grad: without
    # the no-grad wrapper a frozen tower would then keep its activations for a backward that never needs them.
    batch = VisionCollator(DataCollatorForSeq2Seq(processor.tokenizer), processor)([rows[0], rows[1]])
    plain = tiny_llava(processor)
    plain.model.vision_tower.requires_grad_(False)
    for m in (model, plain):
        m.enable_input_require_grads()
        m.train()
    assert saved_in_tower(model, batch) == 0
    assert saved_in_tower(plain, batch) > 0  # the check can fail


def saved_in_tower(model, batch) -> int:
    inside, saved = [False], [0]

    def pack(t):
        saved[0] += inside[0]
        return t

    tower = model.model.vision_tower
    hooks = [
        tower.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True)),
        tower.register_forward_hook(lambda *a: inside.__setitem__(0, False)),
    ]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**{k: v for k, v in batch.items() if k != "labels"})
    for h in hooks:
        h.remove()
    return saved[0]


def test_unused_vision_parameters_are_frozen_and_image_less_batches_still_reach_the_tower(processor):
    model = prepared(processor)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all("post_layernorm" in n for n in frozen)  # LLaVA reads the states before it
    ids = processor.tokenizer("Hello there", return_tensors="pt")["input_ids"]
    model.train()
    model(input_ids=ids).logits.sum().backward()
    vision = [
        p for n, p in model.named_parameters() if p.requires_grad and "language_model" not in n and "lm_head" not in n
    ]
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision)  # present, and exactly zero


def test_processor_that_does_not_fit_the_tower_is_a_clear_error(processor):
    wrong = llava_processor(processor.tokenizer, image_size=32, patch_size=8)  # 16 placeholders per image
    cfg = ModelConfig(name_or_path="tiny")
    with pytest.raises(RecipeError, match="expands one image into 16 '<image>' tokens but the vision tower gives 4"):
        prepare_vlm(tiny_llava(processor), cfg, wrong)


def test_lora_targets_only_the_language_model_and_the_projector_still_trains(processor):
    model = prepared(processor, freeze=["vision_tower"], lora=True)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    lora = [n for n in trainable if "lora_" in n]
    assert lora and all(".language_model." in n for n in lora)
    assert not any("vision_tower" in n for n in trainable)
    assert sorted(n for n in trainable if "lora_" not in n) == sorted(
        n for n in trainable if "multi_modal_projector.modules_to_save" in n
    )
    assert any("multi_modal_projector" in n for n in trainable)


def test_lr_multiplier_reaches_the_projector_by_its_module_name(processor):
    from finetune.training.optim import param_groups

    groups = param_groups(prepared(processor), OptimConfig(lr_multipliers={"model.multi_modal_projector": 10}), 1e-3)
    fast = [g for g in groups if g["lr"] == pytest.approx(1e-2)]
    assert fast and all(n.startswith("model.multi_modal_projector.") for g in fast for n in g["names"])
    assert {n for g in fast for n in g["names"]} == {
        n for n, _ in prepared(processor).named_parameters() if n.startswith("model.multi_modal_projector.")
    }
    # the short name matches as model.freeze's prefixes do, also under LoRA (peft's modules_to_save copy)
    short = param_groups(prepared(processor), OptimConfig(lr_multipliers={"multi_modal_projector": 10}), 1e-3)
    assert [sorted(g["names"]) for g in short] == [sorted(g["names"]) for g in groups]
    lora = prepared(processor, freeze=("vision_tower",), lora=True)
    fast = [
        g
        for g in param_groups(lora, OptimConfig(lr_multipliers={"multi_modal_projector": 10}), 1e-3)
        if g["lr"] == pytest.approx(1e-2)
    ]
    assert fast and all("multi_modal_projector.modules_to_save" in n for g in fast for n in g["names"])


# ---- through the recipe: a VLM folder (the hub path), two ranks, recipes/vlm.yaml ----


def ask_about_an_image(folder: Path, image, new_tokens: int):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    text = proc.apply_chat_template([user(None, "Describe the image.")], tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return (
        model,
        proc.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True),
        out.shape[1] - inputs["input_ids"].shape[1],
    )


@pytest.mark.e2e
def test_a_vlm_folder_trains_through_build_then_reloads_and_answers(tiny_vlm_folder, tmp_path):
    from finetune.assemble import build

    out = tmp_path / "out"
    cfg = load_config(
        [
            f"model.name_or_path={tiny_vlm_folder}",
            "data.source=shapes_captions",
            "data.limit=8",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.max_steps=2",
            f"train.output_dir={out}",
            "log.wandb_mode=disabled",
            "model.freeze=[vision_tower]",
            "optim.lr_multipliers={model.multi_modal_projector: 10}",
        ]
    )
    trainer = build(cfg)
    trainer.train()
    trainer.save_model(str(out))
    logged = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
    assert len(logged) == 2 and all(e["window_label_tokens"] > 0 for e in logged)
    model, answer, generated = ask_about_an_image(out, shapes_captions.render(shapes_captions.scene(0)), 5)
    assert generated == 5 and isinstance(answer, str)
    base = LlavaForConditionalGeneration.from_pretrained(tiny_vlm_folder)
    assert torch.equal(
        model.model.vision_tower.encoder.layers[0].mlp.fc1.weight,
        base.model.vision_tower.encoder.layers[0].mlp.fc1.weight,
    )
    assert not torch.equal(
        model.model.multi_modal_projector.linear_1.weight, base.model.multi_modal_projector.linear_1.weight
    )


@pytest.mark.e2e
@pytest.mark.parametrize(
    "batching",
    [
        ["data.batching=packed"],
        ["data.batching=length_grouped"],
        ["data.batching=token_budget", "data.max_tokens_per_micro_batch=300", "train.global_batch_tokens=600"],
    ],
    ids=lambda b: b[0].split("=")[1],
)
def test_every_batching_mode_carries_each_rows_images(tiny_vlm_folder, batching, tmp_path):
    from finetune.assemble import build

    cfg = load_config(
        [
            f"model.name_or_path={tiny_vlm_folder}",
            "data.source=shapes_captions",
            "data.limit=12",
            "data.max_length=150",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.max_steps=1",
            f"train.output_dir={tmp_path}",
            "log.wandb_mode=disabled",
            *batching,
        ]
    )
    trainer = build(cfg)
    image_id = trainer.processing_class.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for batch in trainer.get_train_dataloader():
        assert int((batch["input_ids"] == image_id).sum()) == TOKENS_PER_IMAGE * batch["pixel_values"].shape[0]
    trainer.train()
    assert trainer.state.global_step == 1


def train_command(capfd, args: list[str], **environ: str):
    """The training command in this process (as `accelerate launch` on one CPU process would run it): it succeeds."""
    result = call(capfd, args, WANDB_MODE="disabled", **environ)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return result


def train_passes(argv: list[str]) -> None:
    """One rank of a two-rank training command: it must succeed."""
    from finetune.tools import train

    assert train.main(argv) == 0


def step_logs(output_dir: Path) -> list[dict]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [e for e in state["log_history"] if "loss" in e and "train_loss" not in e]


@pytest.mark.e2e
@pytest.mark.distributed
def test_two_ranks_with_image_less_rows_and_a_training_tower_match_one_process(tiny_vlm_folder, tmp_path, capfd):
    """One image among four rows: at every step some rank has no image; with the tower training, DDP needs every
    rank to give it a gradient (the zero-weighted dummy image) or the run hangs."""
    data = image_rows(tmp_path)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    shape = {"messages": [{"role": "user", "content": "Name a shape."}, {"role": "assistant", "content": "A square."}]}
    write_jsonl(data, [rows[3], rows[1], rows[2], shape])
    common = [
        f"model.name_or_path={tiny_vlm_folder}",
        f"data.source={data}",
        "train.micro_batch_size=1",
        "train.global_batch_size=2",
        "train.max_steps=2",
        "optim.name=sgd",
        "optim.lr=0.5",
        "log.wandb_mode=disabled",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    train_command(capfd, [*common, f"train.output_dir={one}"])
    forked_ranks(train_passes, [*common, f"train.output_dir={two}"], ACCELERATE_USE_CPU="true", WANDB_MODE="disabled")
    for a, b in zip(step_logs(one), step_logs(two), strict=True):
        assert b["window_label_tokens"] == a["window_label_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    from safetensors.torch import load_file

    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert any(
        "vision_tower" in n and not torch.equal(w1[n], load_file(tiny_vlm_folder / "model.safetensors")[n]) for n in w1
    )  # the tower trained
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # slow: trains recipes/vlm.yaml over the real SmolLM2-135M
@pytest.mark.e2e
def test_vlm_recipe_end_to_end_saves_a_model_that_answers_about_an_image(tmp_path, capfd):
    """recipes/vlm.yaml as users run it (fewer, shorter steps); then AutoProcessor + AutoModelForImageTextToText."""
    out = tmp_path / "vlm"
    result = train_command(
        capfd,
        [
            "recipe=recipes/vlm.yaml",
            f"train.output_dir={out}",
            "train.max_steps=2",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "data.limit=16",
            "schedule.warmup_steps=1",
            "log.wandb_mode=disabled",
        ],
        ACCELERATE_USE_CPU="true",
    )
    assert "shapes_captions (messages+images): 14 of 14 rows kept" in result.stdout  # 2 held out (eval.fraction)
    logs = step_logs(out)
    assert len(logs) == 2 and all(e["window_label_tokens"] > 0 for e in logs)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "eval_loss" in e] == [0, 2]  # before the first step and at the end
    assert result.stdout.count("  held out 1: [image] ") == 2
    model, answer, generated = ask_about_an_image(out, shapes_captions.render(shapes_captions.scene(1)), 8)
    assert generated == 8 and answer.strip()
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert model.config.text_config.hidden_size == 576  # SmolLM2-135M

    from safetensors.torch import load_file

    from finetune.model.llava import assembled_folder
    from finetune.model.loading import model_folder

    cfg = load_config(["recipe=recipes/vlm.yaml"]).model
    base = load_file(assembled_folder(cfg, model_folder(cfg)) / "model.safetensors")
    trained = load_file(out / "model.safetensors")
    tower = [n for n in base if "vision_tower." in n]  # saved under the checkpoint's own (legacy LLaVA) key names
    projector = [n for n in base if "multi_modal_projector." in n]
    assert tower and all(torch.equal(trained[n], base[n]) for n in tower)  # model.freeze: bit-identical
    assert projector and not any(torch.equal(trained[n], base[n]) for n in projector)
