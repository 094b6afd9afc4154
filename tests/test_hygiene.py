"""The suite's own policy (tests/hygiene.py): CPU kernel tests per CPU flag, with faked flags."""

from __future__ import annotations

import pytest

from runtime.kernels import gguf_cpu
from tests.hygiene import kernel_report, require_cpu_kernel

NEEDS = frozenset({"avx512f", "avx512_bf16"})
AVX2_ONLY = {"sse2", "avx2", "fma", "avx512f"}
XEON = set(gguf_cpu.KERNEL_FLAGS)


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
    assert "gguf (avx512_bf16) no (lacks avx512_bf16, avx512bw, avx512vl, f16c)" in line
    assert "amx no" in line and " yes" not in line.split("(kernel tests")[0]
    assert "amx yes" in kernel_report(XEON | {"amx_tile", "amx_bf16"})
