"""The default tier's time budget (tests/budget.py): on CI (CI=true) or with FINETUNE_TEST_BUDGET=enforce it fails a
test over it with its name and time; elsewhere the session ends listing the tests over it with their times, and none
fails. Either way it charges a shared fixture once, charges no wait for another worker's turn, and leaves the slow tier
alone: shown on a throwaway test file run by pytest's own pytester."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

# the plugin is already imported by this folder's conftest: nothing for pytester's run to rewrite
OPTIONS = ("-p", "tests.budget", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning")
TESTS = """
import time

import pytest


@pytest.fixture(scope="session")
def shared():
    time.sleep(0.5)


def test_quick():
    pass


def test_deliberately_slow():
    time.sleep(1.2)


def test_first_to_use_the_shared_fixture(shared):
    pass


def test_second_to_use_the_shared_fixture(shared):
    pass


def test_waiting_for_another_workers_turn():
    from tests.budget import not_charged

    time.sleep(1.2)
    not_charged(1.0)  # as tests.launch.forked_ranks does for its wait at the lock


@pytest.mark.slow
def test_in_the_slow_tier():
    time.sleep(1.2)
"""


def budget_env(monkeypatch, ci: str | None = None, mode: str | None = None) -> None:
    """CI and FINETUNE_TEST_BUDGET as given (None: unset), whatever the machine running this suite has."""
    for name, value in (("CI", ci), ("FINETUNE_TEST_BUDGET", mode)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def summary(text: str) -> list[tuple[float, str]]:
    """(seconds, test) of each line of the session's closing list of tests over the budget, in its order."""
    tail = text[text.index("over the default tier's budget of 0.4 s (") :] if "budget of 0.4 s (" in text else ""
    return [(float(s), name) for s, name in re.findall(r"^ +([\d.]+) s  test_timed\.py::(\w+)$", tail, re.M)]


OVER = ["test_deliberately_slow", "test_first_to_use_the_shared_fixture"]  # 1.2 s; 0.5 s of the shared fixture


@pytest.mark.parametrize("ci, mode", [("true", None), (None, "enforce")], ids=["CI", "enforced here"])
def test_a_test_over_the_budget_fails_with_its_name_and_time_on_ci_or_when_enforced(pytester, monkeypatch, ci, mode):
    budget_env(monkeypatch, ci=ci, mode=mode)
    pytester.makepyfile(test_timed=TESTS)
    result = pytester.runpytest(*OPTIONS, "--test-budget=0.4")
    # each error is a teardown's report: the deliberately slow test's, and the shared fixture's first user's
    result.assert_outcomes(passed=6, errors=2)
    text = result.stdout.str()
    spent = re.search(r"test_timed\.py::test_deliberately_slow took ([\d.]+) s \(setup \+ call \+ teardown\)", text)
    assert spent and 1.2 <= float(spent.group(1)) < 5, text
    assert "over the default tier's budget of 0.4 s" in text
    # the session fixture (0.5 s) is charged to its first user alone, and the slow tier has no budget
    assert "test_first_to_use_the_shared_fixture took" in text
    assert "test_second_to_use_the_shared_fixture took" not in text and "test_in_the_slow_tier took" not in text
    assert "test_waiting_for_another_workers_turn took" not in text  # 1.2 s, 1.0 of them waiting: not charged
    assert "2 over the default tier's budget of 0.4 s (failed)" in text
    listed = summary(text)
    assert [name for _, name in listed] == OVER and abs(listed[0][0] - float(spent.group(1))) < 0.05, text


@pytest.mark.parametrize(
    "ci, mode, workers",
    [(None, None, ["-n", "2", "--dist", "loadfile"]), ("true", "report", [])],
    ids=["not CI, on make test's xdist workers", "reported on CI"],
)
def test_elsewhere_the_session_lists_the_tests_over_the_budget_with_their_times_and_fails_none(
    pytester, monkeypatch, ci, mode, workers
):
    budget_env(monkeypatch, ci=ci, mode=mode)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # xdist's workers import tests.budget themselves
    pytester.makepyfile(test_timed=TESTS)
    result = pytester.runpytest(*OPTIONS, "--test-budget=0.4", *workers)
    result.assert_outcomes(passed=6)
    assert result.ret == pytest.ExitCode.OK
    text = result.stdout.str()
    assert "2 over the default tier's budget of 0.4 s (reported, not failed)" in text
    listed = summary(text)
    assert [name for _, name in listed] == OVER, text  # the slowest first; the same charging rules as on CI
    assert 1.2 <= listed[0][0] < 5 and 0.5 <= listed[1][0] < listed[0][0], listed
    assert "FINETUNE_TEST_BUDGET=enforce does here" in text and " took " not in text


@pytest.mark.parametrize(
    "ci, mode, chosen",
    [
        ("true", None, "enforce"),
        ("1", None, "enforce"),
        (None, None, "report"),
        ("false", None, "report"),
        ("", None, "report"),
        ("false", "enforce", "enforce"),
        ("true", "report", "report"),  # the variable, set on purpose, wins over the machine's CI
        (None, " Enforce ", "enforce"),
    ],
)
def test_the_budget_is_enforced_on_ci_and_where_asked_and_reported_elsewhere(monkeypatch, ci, mode, chosen):
    from tests.budget import budget_mode

    budget_env(monkeypatch, ci=ci, mode=mode)
    assert budget_mode() == chosen


def test_an_unknown_budget_mode_is_a_usage_error(pytester, monkeypatch):
    budget_env(monkeypatch, mode="strict")
    pytester.makepyfile(test_timed=TESTS)
    result = pytester.runpytest(*OPTIONS)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "FINETUNE_TEST_BUDGET='strict': set it to enforce or report" in result.stderr.str()


def test_a_zero_budget_turns_the_check_off_even_on_ci(pytester, monkeypatch):
    budget_env(monkeypatch, ci="true")
    pytester.makepyfile(test_timed=TESTS)
    result = pytester.runpytest(*OPTIONS, "--test-budget=0")
    result.assert_outcomes(passed=6)
    assert "over the default tier's budget" not in result.stdout.str()


HOLD_SHARE = """
import fcntl, sys, time
lock = open(sys.argv[1], "a")
fcntl.flock(lock, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""
TRY_LOCK = """
import fcntl, sys
try:
    fcntl.flock(open(sys.argv[1], "a"), getattr(fcntl, sys.argv[2]) | fcntl.LOCK_NB)
    print("granted")
except BlockingIOError:
    print("refused")
"""


def another_worker_tries(mode: str) -> str:
    from tests.launch import CORES_LOCK

    return subprocess.run(
        [sys.executable, "-c", TRY_LOCK, CORES_LOCK, mode], capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_turn_at_the_cores_waits_for_the_other_workers_running_test_uncharged_and_then_keeps_them_out():
    """Another worker's running test (a process holding its share of the lock for 1.5 s) is waited for, the wait is
    not charged to this test's budget, and while the turn lasts no other test starts; after it, this test is back
    to its share (tests/conftest.py holds one for every test) and others may run beside it."""
    from tests import budget
    from tests.launch import CORES_LOCK, turn_at_the_cores

    holder = subprocess.Popen([sys.executable, "-c", HOLD_SHARE, CORES_LOCK, "1.5"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    uncharged, asked = budget.uncharged[0], time.monotonic()
    with turn_at_the_cores():
        waited = time.monotonic() - asked
        assert holder.wait(timeout=5) == 0  # the turn began as the other test ended
        assert another_worker_tries("LOCK_SH") == "refused"
    assert 1.0 < waited < 10 and abs(budget.uncharged[0] - uncharged - waited) < 0.05
    assert another_worker_tries("LOCK_SH") == "granted" and another_worker_tries("LOCK_EX") == "refused"
