"""Suite-wide test policy (a pytest plugin, registered in conftest.py).

``slow``: a test is slow when it needs the real model, a browser, a Prometheus server or a
C++ kernel build, or takes more than ~2 s on an idle 2-core machine. Tests that request a
fixture of :data:`SLOW_FIXTURES` (or carry the ``model`` marker) are marked here at
collection; the others carry ``@pytest.mark.slow`` in their module. ``make test-fast`` runs
the rest: the gateway logic over FakeBackend. With ``SPARKGATE_FAST_BUDGET_S=<seconds>`` a
test not marked slow fails when its call takes longer: a cheap check for a fast test that
has become slow (set it only on an otherwise idle machine, e.g. 3).

CPU kernels: :func:`require_cpu_kernel` is the one policy for tests of a kernel that needs
particular CPU instructions. Where the CPU has them the tests are required (a kernel that
does not build fails them, locally and under CI); where it lacks them they skip, naming the
missing flags. The run's summary says which kernel paths run.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

#: Fixtures that make a test slow: the real model (``target_fp32``, ``tokenizer`` and
#: ``live_server`` build on ``model_dir``), headless Chromium, the gguf kernel's C++ build.
SLOW_FIXTURES = frozenset({"model_dir", "browser", "gguf_kernel"})
FAST_BUDGET_ENV = "SPARKGATE_FAST_BUDGET_S"
_BUDGET = pytest.StashKey[float | None]()


def _kernels() -> dict[str, frozenset[str]]:
    """Kernel path → the CPU flags it needs (as ``runtime.config`` states them)."""
    from runtime.config import AMX_FLAGS, KERNEL_FLAGS

    return {"gguf (avx512_bf16)": KERNEL_FLAGS, "amx": AMX_FLAGS}


def missing_cpu_flags(required: frozenset[str], flags: set[str] | None = None) -> list[str]:
    """The flags of ``required`` this CPU (or the given ``flags``) lacks, sorted."""
    if flags is None:
        from runtime.config import cpu_flags

        flags = cpu_flags()
    return sorted(required - flags)


def require_cpu_kernel(what: str, required: frozenset[str], available: Callable[[], bool],
                       flags: set[str] | None = None) -> None:
    """Skip when the CPU lacks a flag of ``required``; fail when it has them all but
    ``available()`` (builds/loads the kernel) is False; return otherwise."""
    missing = missing_cpu_flags(required, flags)
    if missing:
        pytest.skip(f"{what}: this CPU lacks {', '.join(missing)}")
    if not available():
        pytest.fail(f"{what}: this CPU has {', '.join(sorted(required))} but the kernel is unavailable "
                    "(build failed? see the log)")


def kernel_report(flags: set[str] | None = None) -> str:
    """One line naming the CPU kernel paths this run exercises, e.g.
    ``CPU kernels: gguf (avx512_bf16) yes, amx no (lacks amx_bf16, amx_tile)``."""
    parts = []
    for name, required in _kernels().items():
        missing = missing_cpu_flags(required, flags)
        parts.append(f"{name} no (lacks {', '.join(missing)})" if missing else f"{name} yes")
    return "CPU kernels: " + ", ".join(parts) + " (kernel tests run where yes, skip where no)"


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(kernel_report())  # after the results, so -q runs (make test) show it too


def pytest_configure(config) -> None:
    budget = os.environ.get(FAST_BUDGET_ENV)  # read once: a test's own env changes do not count
    config.stash[_BUDGET] = float(budget) if budget else None


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.get_closest_marker("model") or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    budget = item.config.stash[_BUDGET]
    report = outcome.get_result()
    if budget is not None and call.when == "call" and report.passed and not item.get_closest_marker("slow") \
            and call.duration > budget:
        report.outcome = "failed"
        report.longrepr = (f"took {call.duration:.1f} s > {FAST_BUDGET_ENV}={budget:g}: "
                           "mark it @pytest.mark.slow (or make it faster)")


@pytest.fixture(scope="session")
def gguf_kernel() -> None:
    """Tests of the gguf C++ kernel (AVX512-BF16): run and required where the CPU can, else skip."""
    from runtime.config import KERNEL_FLAGS
    from runtime.kernels.cpu import gguf_cpu

    require_cpu_kernel("the gguf CPU kernel", KERNEL_FLAGS, gguf_cpu.kernel_available)
