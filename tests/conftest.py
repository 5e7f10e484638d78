import os
from pathlib import Path

import pytest

# Tests never reach a hub or a W&B server, and stay within CI's two cores.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="module")
def processor():
    """The tiny LLaVA's processor (tests/vlm_models.py), once per test module."""
    from tests.vlm_models import tiny_processor

    return tiny_processor()


@pytest.fixture(scope="module")
def tiny_vlm_folder(processor, tmp_path_factory) -> Path:
    """A tiny LLaVA and its processor saved together: what a hub VLM id resolves to."""
    from tests.vlm_models import save_tiny_vlm

    return save_tiny_vlm(processor, tmp_path_factory.mktemp("tiny_vlm"))


# the default tier's time budget (--test-budget): its hooks, loaded here as a plugin of this folder's conftest
from tests.budget import (  # noqa: E402, F401
    pytest_addoption,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)


def pytest_sessionstart(session):
    """Each pytest-xdist worker imports the training stack once, before its first test, and finds the machine's
    one-time caches built (tests.data_files.build_caches: the first worker builds them, the other waits): torch,
    transformers' Trainer, accelerate, peft and datasets take 10-15 s to import on two cores, and converting SmolLM2's
    GGUF about as long, which the budget (tests/budget.py) would otherwise charge to whichever test needs them first."""
    import finetune.assemble  # noqa: F401
    from tests.data_files import build_caches

    build_caches()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test runs holding its share of the machine's cores; one whose ranks need them all (forked ranks, a
    two-rank launch) waits for the other workers' running tests and keeps their next ones waiting (tests.launch)."""
    from tests.launch import share_of_the_cores

    with share_of_the_cores():
        return (yield)
