"""Test configuration shared by every op: hypothesis profiles, the device fixture, markers.

Hypothesis profiles (``HYPOTHESIS_PROFILE``):

- ``ci`` (default): derandomized, 12 examples per property. The same examples every run, so CI
  on 2 CPU cores is bounded and a red run is red again; it never explores beyond them.
- ``gpu``: random, 300 examples per property, for a CUDA machine. ``.ci/gpu_job`` draws a seed,
  prints it and passes it as ``--hypothesis-seed``, so every run explores new examples and any
  run can be replayed: ``HYPOTHESIS_PROFILE=gpu python -m pytest --hypothesis-seed=SEED`` (or
  ``HYPOTHESIS_SEED=SEED bash .ci/gpu_job tests``) draws the same examples for every test at the
  same commit. A failure also prints its ``@reproduce_failure`` blob.
- ``dev``: random, 5 examples, for a quick local run.

``HYPOTHESIS_MAX_EXAMPLES=N`` replaces the profile's example count (e.g. the ``gpu`` profile at 60
examples, for a whole-suite run that fits one device call).

The report header and the summary line name the profile and the seed. The suite turns the
host-side content checks on (``ATTNREF_CHECK_CONTENTS=1`` unless already set).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, settings

import triton_impl  # noqa: F401  (selects the interpreter before any kernel module is imported)
from triton_impl.validation import CONTENT_CHECKS_ENV

# The suite runs with the host-side content checks on everywhere (on CUDA they are opt-in for
# serving); tests of the checks-off path set the variable themselves.
os.environ.setdefault(CONTENT_CHECKS_ENV, "1")

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=12,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu",
    derandomize=False,
    max_examples=300,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=5, deadline=None, print_blob=True)
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if os.environ.get("HYPOTHESIS_MAX_EXAMPLES"):
    settings.register_profile(_PROFILE, settings.get_profile(_PROFILE),
                              max_examples=int(os.environ["HYPOTHESIS_MAX_EXAMPLES"]))  # fmt: skip
settings.load_profile(_PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA (compiled Triton)")
    config.addinivalue_line("markers", "slow: long-running; excluded from the default run")


def _seed_note(config: pytest.Config) -> str:
    """How this run's examples were drawn, for the log: enough to replay a random run."""
    if settings.default.derandomize:
        return "derandomized"
    seed = config.getoption("--hypothesis-seed")
    return f"--hypothesis-seed={seed}" if seed is not None else "random seed per test, not replayable by seed"


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile {_PROFILE}: {_seed_note(config)}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda when present (compiled kernels), else cpu (kernels under the Triton interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_launches = {"count": 0}


def _count_launch(*_args, **_kwargs) -> None:
    _launches["count"] += 1


def pytest_sessionstart(session: pytest.Session) -> None:
    """With ATTNREF_COUNT_LAUNCHES=1 (compiled runs, e.g. under compute-sanitizer), count launches."""
    if os.environ.get("ATTNREF_COUNT_LAUNCHES") != "1":
        return
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # a chain of hooks (Triton 3.6 and 3.9 both have one)
        hook.add(_count_launch)
    else:  # a single hook
        knobs.runtime.launch_enter_hook = _count_launch


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Carry each property test's example count in the report (survives pytest-xdist)."""
    outcome = yield
    report = outcome.get_result()
    stats = getattr(item, "hypothesis_statistics", None)
    if report.when == "teardown" and stats:
        examples = sum(int(n) for n in re.findall(r"- (\d+) passing", stats))
        report.user_properties.append(("hypothesis_examples", examples))


TEST_TIMES_ENV = "ATTNREF_TEST_TIMES"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``ATTNREF_TEST_TIMES=<file>``, append each phase of each test (setup, call, teardown) to that file as its
    report arrives (under pytest-xdist, on the controller): seconds, phase, outcome, test id, a line each, tab
    separated. A run that a time limit cuts still says where its time went (``.ci/gpu_job`` sums it by test)."""
    path = os.environ.get(TEST_TIMES_ENV)
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # a worker's reports reach the controller's hook too
        with open(path, "a") as times:
            times.write(f"{report.duration:.3f}\t{report.when}\t{report.outcome}\t{report.nodeid}\n")


def pytest_terminal_summary(terminalreporter) -> None:
    examples = sum(
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        for key, value in getattr(report, "user_properties", ())
        if key == "hypothesis_examples"
    )
    terminalreporter.write_line(
        f"hypothesis examples run: {examples} (hypothesis profile {_PROFILE}, {_seed_note(terminalreporter.config)})"
    )
    if os.environ.get("ATTNREF_COUNT_LAUNCHES") == "1":
        terminalreporter.write_line(f"Triton kernel launches: {_launches['count']}")
