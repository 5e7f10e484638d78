"""The default tier's time budget, a pytest plugin (tests/conftest.py loads it): a test whose setup + call + teardown
take longer than `--test-budget` seconds fails at its teardown with its name and time, unless it is in the slow
tier (marked `slow`) or needs a GPU (marked `gpu`: the GPU machine's tier). A fixture shared by a module or the
session is set up once, so its cost is charged once: to the first test that uses it; a wait for another worker's
test to end (ranks run with the cores to themselves: tests.launch.turn_at_the_cores) is not charged. Where a new
test belongs: docs/contributing.md ("The two tiers")."""

from __future__ import annotations

import pytest

BUDGET_S = 20.0  # a default-tier test on CI's 2-core machine, one thread, fixtures included
EXEMPT = ("slow", "gpu")
SPENT = pytest.StashKey[float]()
uncharged = [0.0]  # seconds of the running test's current phase spent waiting for another worker (not_charged)


def not_charged(seconds: float) -> None:
    """Time the running test waited for another pytest-xdist worker's turn at what they share (the cores, for forked
    ranks: tests.launch.forked_ranks): not the test's own cost."""
    uncharged[0] += seconds


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--test-budget",
        type=float,
        default=BUDGET_S,
        metavar="SECONDS",
        help=f"fail a test outside the slow tier that takes longer (setup + call + teardown; default {BUDGET_S:g}; "
        "0: no budget)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: the slow tier (`make test-slow`); its reason beside the marker")


def is_budgeted(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(name) for name in EXEMPT)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    spent = item.stash.get(SPENT, 0.0) + call.duration - uncharged[0]
    uncharged[0] = 0.0
    item.stash[SPENT] = spent
    budget = item.config.getoption("--test-budget")
    if report.when == "teardown" and budget and spent > budget and report.passed and is_budgeted(item):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {spent:.1f} s (setup + call + teardown), over the default tier's budget of "
            f"{budget:g} s: make it faster (in-process, a smaller model, a shared fixture) or mark it slow with its "
            "reason (docs/contributing.md)"
        )
    return report
