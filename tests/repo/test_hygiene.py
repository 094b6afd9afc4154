"""The suite's own policy (tests/support/hygiene.py): CPU kernel tests per CPU flag, with faked
flags, and the ``slow`` marking and fast-test time budget, run in an inner pytest session."""

from __future__ import annotations

import pytest

from runtime import config
from runtime.kernels.cpu import gguf_cpu  # noqa: F401 — imported here: the inner sessions must not re-import torch
from tests.support.hygiene import FAST_BUDGET_ENV, SLOW_FIXTURES, kernel_report, require_cpu_kernel

NEEDS = frozenset({"avx512f", "avx512_bf16"})
AVX2_ONLY = {"sse2", "avx2", "fma", "avx512f"}
XEON = set(config.KERNEL_FLAGS)


def _never_built() -> bool:
    raise AssertionError("the kernel must not be built on a CPU that lacks its instructions")


@pytest.mark.parametrize("ci", ["", "true"])
def test_kernel_tests_skip_naming_the_missing_flag_where_the_cpu_lacks_it(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match=r"the gguf CPU kernel: this CPU lacks avx512_bf16$"):
        require_cpu_kernel("the gguf CPU kernel", NEEDS, _never_built, flags=AVX2_ONLY)


@pytest.mark.parametrize("ci", ["", "true"])
def test_kernel_tests_are_required_where_the_cpu_has_the_flags(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="has avx512_bf16, avx512f but the kernel is unavailable"):
        require_cpu_kernel("the gguf CPU kernel", NEEDS, lambda: False, flags=XEON)
    built = []
    assert require_cpu_kernel("the gguf CPU kernel", NEEDS, lambda: built.append(1) or True, flags=XEON) is None
    assert built == [1]


def test_report_names_the_kernel_paths_that_run():
    assert kernel_report(XEON).startswith("CPU kernels: gguf (avx512_bf16) yes, amx no (lacks amx_bf16, amx_tile)")
    line = kernel_report(AVX2_ONLY)
    assert "gguf (avx512_bf16) no (lacks avx512_bf16, avx512_vnni, avx512bw, avx512vl, f16c)" in line
    assert "amx no" in line and " yes" not in line.split("(kernel tests")[0]
    assert "amx yes" in kernel_report(XEON | {"amx_tile", "amx_bf16"})


INNER = """
import time
import pytest

@pytest.fixture
def target_fp32(model_dir):
    return model_dir
""" + "".join(f"""
@pytest.fixture
def {name}():
    return 1

def test_needs_{name}({name}):
    pass
""" for name in sorted(SLOW_FIXTURES)) + """

def test_uses_the_model(target_fp32):
    pass

@pytest.mark.model
def test_marked_model():
    pass

def test_plain():
    pass

def test_sleepy():
    time.sleep(0.3)

@pytest.mark.slow
def test_sleepy_but_slow():
    time.sleep(0.3)
"""


PLUGINS = ("-p", "tests.support.hygiene", "-p", "no:asyncio")  # the inner sessions read no pyproject.toml


def test_real_model_tests_are_slow_and_fast_ones_keep_a_budget(pytester, monkeypatch):
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.delenv(FAST_BUDGET_ENV, raising=False)
    fast = pytester.runpytest_inprocess(*PLUGINS, "-m", "not slow", "-k", "not sleepy")
    fast.assert_outcomes(passed=1, deselected=4 + len(SLOW_FIXTURES))  # only test_plain
    assert any(line.startswith("CPU kernels: ") for line in fast.outlines)
    monkeypatch.setenv(FAST_BUDGET_ENV, "0.1")
    timed = pytester.runpytest_inprocess(*PLUGINS, "-k", "sleepy")
    timed.assert_outcomes(passed=1, failed=1)  # a fast test over budget fails, a slow one may take its time
    timed.stdout.fnmatch_lines([f"took * s > {FAST_BUDGET_ENV}=0.1: mark it @pytest.mark.slow (or make it faster)",
                                "FAILED test_inner.py::test_sleepy - took *"])
