"""Packed image-text rows: exact against the float64 per-row reference (unpadded, one row at a time), their images in
order, position ids restarting per row, attention within each row; `verify` on a packed VLM recipe; and the bad
input of packing (several images in a row, an image past data.max_length, a VLM that cannot pack) as one line."""

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from finetune import TokenNormTrainer
from finetune.data import shapes_captions
from finetune.data.batching import row_collator
from finetune.data.images import open_image
from finetune.data.vision import VisionCollator, load_vision_dataset
from finetune.model.llava import IMAGE_TOKEN
from finetune.model.packed_attention import use_for_packed_rows
from finetune.recipe import Batching, DataConfig, RecipeError
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import SnapshotCallback, sgd_args
from finetune.tools import verify
from tests.launch import call
from tests.vlm_models import Recording, prepared, tiny_llava


@pytest.fixture(scope="module")
def proc(processor):
    return processor


class CacheOnTrainer(TokenNormTrainer):
    """The trainer as it was before packed image rows were exact: a VLM's forward takes use_cache through **kwargs,
    so a KV cache stayed on and transformers ignored the restarting position_ids (the check below must see it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forward_takes = dataclasses.replace(self.forward_takes, no_cache={"use_cache": True})


TWO_IMAGES = {
    "images": [shapes_captions.render(shapes_captions.scene(k)) for k in range(2)],
    "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": "Two pictures."},
    ],
}


def packed_rows(proc):
    """Short shapes_captions rows (one image each), one image-less row and one with two images, in a fixed order."""
    import datasets

    shapes, _ = load_vision_dataset(DataConfig(source="shapes_captions", limit=16, batching="packed"), proc)
    order = sorted(range(len(shapes)), key=lambda k: len(shapes[k]["input_ids"]))[:4]
    chat = {"messages": [{"role": "user", "content": "Name a shape."}, {"role": "assistant", "content": "A circle."}]}
    plain, _ = load_vision_dataset(DataConfig(source="x", batching="packed"), proc, [("text row", chat)])
    two, _ = load_vision_dataset(DataConfig(source="x", batching="packed"), proc, [("two images", TWO_IMAGES)])
    rows = shapes.select(order[:2]).to_list() + plain.to_list() + two.to_list() + shapes.select(order[2:]).to_list()
    return datasets.Dataset.from_list(rows, features=shapes.features)


@pytest.mark.parametrize("attention", ["packed_sdpa", "sdpa", "sdpa_with_cache"])
def test_packed_image_rows_match_the_float64_per_row_reference(proc, attention, tmp_path):
    """Tower, projector and language model all train (a misplaced image would move their gradients); 3 rows per
    packed row, 2 packed rows per window."""
    initial = prepared(proc)
    model = copy.deepcopy(initial)
    if attention == "packed_sdpa":
        assert use_for_packed_rows(model, "data.batching=padded").startswith("attention: packed_sdpa")
        assert model.config.vision_config._attn_implementation == "sdpa"  # the tower keeps its own attention
    inner = VisionCollator(row_collator(Batching("packed", 1, None), proc.tokenizer), proc)
    collator = Recording(inner)
    trainer = (CacheOnTrainer if attention == "sdpa_with_cache" else TokenNormTrainer)(
        model=model,
        train_dataset=packed_rows(proc),
        data_collator=collator,
        args=sgd_args(tmp_path, 3, 2, train_sampling_strategy="sequential"),
    )
    snapshots = SnapshotCallback()
    trainer.add_callback(snapshots)
    trainer.train()

    image_id = proc.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for rows, batch in zip(collator.batches, collator.packed):
        assert batch["input_ids"].shape[0] == 1  # one packed row
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
        assert starts == [0, *torch.tensor([len(r["input_ids"]) for r in rows]).cumsum(0)[:-1].tolist()]
        images = [img for r in rows for img in r["images"]]
        assert int((batch["input_ids"] == image_id).sum()) == 4 * len(images) == batch["pixel_values"].shape[0] * 4
        expected = proc.image_processor([open_image(i["bytes"] or i["path"]) for i in images], return_tensors="pt")
        assert torch.equal(batch["pixel_values"], expected["pixel_values"])  # the rows' images, in row order
    assert [[len(r["images"]) for r in rows] for rows in collator.batches] == [[1, 1, 0], [2, 1, 1]]

    def forward(model, seq):
        pixels = {}
        if seq["images"]:
            images = [open_image(ref["bytes"] or ref["path"]) for ref in seq["images"]]
            pixels["pixel_values"] = proc.image_processor(images, return_tensors="pt")["pixel_values"].double()
        return model(input_ids=torch.tensor([seq["input_ids"]]), **pixels).logits

    windows = [collator.batches[0] + collator.batches[1]]
    errors = []
    for k, window in enumerate(windows):
        reference = copy.deepcopy(initial)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(snapshots.snapshots[k][name])
        grads, _ = reference_gradient(reference, window, forward)
        applied = {n: snapshots.snapshots[k][n] - snapshots.snapshots[k + 1][n] for n in grads}
        errors.append(relative_error(applied, grads))
    if attention == "sdpa_with_cache":
        assert min(errors) > 1e-2  # the check fails where attention crosses the packed rows
    else:
        assert max(errors) <= 1e-5


def test_an_image_past_max_length_names_the_row(proc, tmp_path):
    records = [("rows.jsonl line 3", TWO_IMAGES)]
    ds, _ = load_vision_dataset(DataConfig(source="x", batching="packed"), proc, records)  # packed rows take them
    assert len(ds[0]["images"]) == 2
    one = shapes_captions.row(0)
    with pytest.raises(RecipeError, match=r"^rows\.jsonl line 1: its image tokens end at token \d+, past data\."):
        load_vision_dataset(DataConfig(source="x", max_length=3), proc, [("rows.jsonl line 1", one)])
    with pytest.raises(RecipeError, match=r"longer than data\.max_length=3"):  # truncation=error: the row's length
        load_vision_dataset(
            DataConfig(source="x", max_length=3, truncation="error"), proc, [("rows.jsonl line 1", one)]
        )


@pytest.fixture(scope="module")
def tiny_vlm_folder(proc, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_vlm")
    tiny_llava(proc).save_pretrained(folder)
    proc.save_pretrained(folder)
    return folder


@pytest.mark.e2e
def test_verify_passes_on_packed_image_rows(tiny_vlm_folder, capsys):
    code = verify.main(
        [
            f"model.name_or_path={tiny_vlm_folder}",
            "data.source=shapes_captions",
            "data.limit=24",
            "data.batching=packed",
            "train.micro_batch_size=4",
            "train.global_batch_size=8",
            "train.max_steps=1",
            "optim.name=sgd",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "attention: packed_sdpa" in out
    error = float(re.search(r"^  relative error (\S+)", out, flags=re.M).group(1))
    assert error <= 1e-5


def one_error_line(capfd, args: list[str], tmp_path: Path) -> str:
    """Run the training command; its one `error:` line (exit 2, no traceback, nothing written)."""
    out = tmp_path / "out"
    result = call(capfd, [*args, f"train.output_dir={out}", "log.wandb_mode=disabled"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-4000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    assert not out.exists() or not any(p.is_file() for p in out.rglob("*"))
    return errors[0]


def tiny_gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16
    )
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = Gemma3Config(
        text_config={**text, "num_key_value_heads": 1},
        vision_config={**vision, "patch_size": 14},
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    return Gemma3ForConditionalGeneration(config)


def test_bad_packed_image_input_is_one_line_exit_2(tiny_vlm_folder, tmp_path, capfd):
    gemma = tmp_path / "gemma3"
    tiny_gemma3().save_pretrained(gemma)
    line = one_error_line(
        capfd, [f"model.name_or_path={gemma}", "data.source=shapes_captions", "data.batching=packed"], tmp_path
    )
    assert re.match(
        r"^error: model\.name_or_path=\S+gemma3: data\.batching=packed cannot pack its image rows exactly: part of "
        r"each sequence attends both ways \(token_type_ids\).*; set data\.batching=token_budget "
        r"data\.max_tokens_per_micro_batch=\d+ train\.global_batch_tokens=\d+ or data\.batching=padded "
        r"\(token_budget: .*\)$",
        line,
    ), line
    rows = tmp_path / "rows.jsonl"
    shapes_captions.render(shapes_captions.scene(0)).save(tmp_path / "0.png")
    one = {"images": ["0.png"], "messages": shapes_captions.row(0)["messages"]}
    rows.write_text(json.dumps(one) + "\n")
    base = [f"model.name_or_path={tiny_vlm_folder}", f"data.source={rows}"]
    line = one_error_line(capfd, [*base, "data.max_length=5"], tmp_path)
    assert re.match(r"^error: \S+rows\.jsonl line 1: its image tokens end at token \d+, past data\.max_length=5", line)


def test_gemma3_image_batches_carry_token_type_ids_so_image_tokens_attend_both_ways():
    """Gemma3's processor marks its image tokens in token_type_ids; without them its training forward attends to them
    causally (not as at inference). The collator's inputs mark them from the token ids alone."""
    from finetune.data.image_inputs import ImageInputs
    from finetune.model.image_rows import forward_inputs

    model = tiny_gemma3().eval()
    ids = torch.tensor([[5, 6, 297, 299, 299, 299, 299, 298, 7, 8]])
    batch = ImageInputs(**forward_inputs(model.config)).add_to(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    )
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 0, 0, 0]]
    pixels = torch.randn(1, 3, 28, 28)
    with torch.no_grad():
        both_ways = model(**batch, pixel_values=pixels).logits
        causal = model(input_ids=ids, attention_mask=batch["attention_mask"], pixel_values=pixels).logits
    assert float((both_ways[0, 3:7] - causal[0, 3:7]).abs().max()) > 1e-4  # the image tokens see each other
    torch.testing.assert_close(both_ways[0, :3], causal[0, :3])  # before the image nothing changes
