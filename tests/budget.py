"""The default tier's time budget, a pytest plugin (tests/conftest.py loads it): a test whose setup + call + teardown
take longer than `--test-budget` seconds is over it, unless it is in the slow tier (marked `slow`) or needs a GPU
(marked `gpu`: the GPU machine's tier). On CI (`CI=true`, as .ci/run sets) such a test fails at its teardown with its
name and time; elsewhere (a busy laptop, a shared 2-core box) the session ends with a list of those over it and their
times, and nothing fails. `FINETUNE_TEST_BUDGET=enforce` fails them anywhere, `FINETUNE_TEST_BUDGET=report` only lists
them. A fixture shared by a module or the session is set up once, so its cost is charged once: to the first test that
uses it; a wait for another worker's test to end (ranks run with the cores to themselves:
tests.launch.turn_at_the_cores) is not charged. Where a new test belongs: docs/contributing.md ("The two tiers")."""

from __future__ import annotations

import os

import pytest

BUDGET_S = 20.0  # a default-tier test on CI's 2-core machine, one thread, fixtures included
EXEMPT = ("slow", "gpu")
MODE_VARIABLE = "FINETUNE_TEST_BUDGET"
MODES = ("enforce", "report")
OVER = "over_the_test_budget_s"  # the user property an over-budget test's teardown report carries (across workers)
SPENT = pytest.StashKey[float]()
MODE = pytest.StashKey[str]()
uncharged = [0.0]  # seconds of the running test's current phase spent waiting for another worker (not_charged)


def not_charged(seconds: float) -> None:
    """Time the running test waited for another pytest-xdist worker's turn at what they share (the cores, for forked
    ranks: tests.launch.forked_ranks): not the test's own cost."""
    uncharged[0] += seconds


def budget_mode() -> str:
    """enforce or report: FINETUNE_TEST_BUDGET where set, else enforce on CI (CI=true) and report elsewhere: a test
    over the budget on a busy machine says that machine is busy, on CI's that the test is too slow."""
    given = os.environ.get(MODE_VARIABLE, "").strip().lower()
    if given in MODES:
        return given
    if given:
        raise pytest.UsageError(
            f"{MODE_VARIABLE}={given!r}: set it to enforce or report (unset: enforce where CI=true)"
        )
    return "enforce" if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes") else "report"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--test-budget",
        type=float,
        default=BUDGET_S,
        metavar="SECONDS",
        help=f"the most a test outside the slow tier may take (setup + call + teardown; default {BUDGET_S:g}; 0: no "
        f"budget); over it fails on CI (CI=true) or with {MODE_VARIABLE}=enforce, else is listed at the end",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: the slow tier (`make test-slow`); its reason beside the marker")
    config.stash[MODE] = budget_mode()


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
        report.user_properties.append((OVER, spent))  # a property: it reaches pytest-xdist's controller
        if item.config.stash[MODE] == "enforce":
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {spent:.1f} s (setup + call + teardown), over the default tier's budget of "
                f"{budget:g} s: make it faster (in-process, a smaller model, a shared fixture) or mark it slow with "
                "its reason (docs/contributing.md)"
            )
    return report


def over_budget(terminalreporter) -> list[tuple[float, str]]:
    """(seconds, test id) of every test the session found over the budget, the slowest first."""
    found = [
        (seconds, report.nodeid)
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, seconds in getattr(report, "user_properties", ())
        if name == OVER
    ]
    return sorted(found, reverse=True)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The tests over the budget with their times: on CI they failed, elsewhere this list is what is said."""
    over = over_budget(terminalreporter)
    if not over:
        return
    enforced = config.stash[MODE] == "enforce"
    budget = config.getoption("--test-budget")
    verdict = "failed" if enforced else "reported, not failed"
    terminalreporter.write_sep("=", f"{len(over)} over the default tier's budget of {budget:g} s ({verdict})")
    for seconds, nodeid in over:
        terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
    if not enforced:
        terminalreporter.write_line(
            f"CI (CI=true) fails these; {MODE_VARIABLE}=enforce does here. On a busy machine the time may be the "
            'machine\'s: run the test alone to check (docs/contributing.md, "The budget")'
        )
