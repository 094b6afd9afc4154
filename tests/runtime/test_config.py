"""``dtype="auto"``: the GGUF kernels where the CPU has AVX512-BF16, else bf16 only where the
CPU multiplies bf16 natively, else fp32 (runtime.config)."""

from __future__ import annotations

from unittest import mock

import pytest

from runtime import config
from runtime.config import EngineConfig, cpu_has_native_bf16, resolve_dtype, resolve_spec_method

EPYC_AVX2 = "processor\t: 0\nflags\t\t: fpu vme sse2 ssse3 fma avx avx2 bmi2 sha_ni\n"
XEON_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 f16c avx avx2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16\n"
SAPPHIRE = "flags\t\t: avx512f amx_tile amx_bf16 amx_int8\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("text,native", [(EPYC_AVX2, False), (XEON_BF16, True), (SAPPHIRE, True),
                                         (GRAVITON, True), ("", False), ("flags: avx512f avx512bw\n", False)])
def test_cpu_bf16_detection_from_cpuinfo(text, native):
    assert cpu_has_native_bf16(text) is native


def test_auto_resolves_by_cpu_and_explicit_names_pass_through():
    assert EngineConfig().dtype == "auto"
    assert resolve_dtype("auto", XEON_BF16) == "gguf"  # AVX512-BF16 (+BW/VL, F16C): the GGUF kernels
    assert resolve_dtype("auto", SAPPHIRE) == "bfloat16"  # AMX listed, but not the kernel's AVX512 subset
    assert resolve_dtype("auto", GRAVITON) == "bfloat16"
    assert resolve_dtype("auto", EPYC_AVX2) == "float32"
    with mock.patch.object(config, "cpu_has_native_bf16", return_value=False):
        assert resolve_dtype("auto", EPYC_AVX2) == "float32"
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype("float32") == "float32"
    assert resolve_dtype("int3") == "int3"  # validated (rejected) by the engine


XEON_AMX = XEON_BF16.rstrip("\n") + " amx_tile amx_bf16 amx_int8\n"


def test_auto_speculates_only_on_the_gguf_path_of_an_amx_cpu():
    """``spec_method="auto"`` (the server's default) is the hybrid where AMX makes verified rows
    cheap, plain decoding elsewhere — never a silent change of an explicit choice."""
    assert resolve_spec_method("auto", resolve_dtype("auto", XEON_AMX), XEON_AMX) == "hybrid"
    assert resolve_spec_method("auto", "gguf", XEON_BF16) == "none"  # AVX512-BF16 without AMX (EPYC, Cooper Lake)
    assert resolve_spec_method("auto", "float32", XEON_AMX) == "none"  # AMX, but the target off the gguf tiles
    assert resolve_spec_method("auto", resolve_dtype("auto", SAPPHIRE), SAPPHIRE) == "none"  # bf16: no kernel
    assert resolve_spec_method("auto", "gguf", EPYC_AVX2) == "none"
    for explicit in ("none", "dspark", "prompt_lookup", "hybrid", "dsaprk"):
        assert resolve_spec_method(explicit, "gguf", XEON_AMX) == explicit  # validated by the engine


def test_engine_rejects_an_unknown_dtype():
    from runtime.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        LLMEngine(EngineConfig(dtype="int3"), lambda rid, ev: None, model=object(), tokenizer=object())


def test_speculator_rejects_an_unknown_policy_at_start_up():
    """An unknown ``spec_policy`` fails when the engine is built, not in every later step."""
    from runtime.speculation.budget import POLICIES
    from runtime.speculation.speculator import Speculator

    with pytest.raises(ValueError, match="spec_policy must be one of"):
        Speculator(EngineConfig(spec_method="dspark", spec_policy="x"), target=object(), num_slots=1, max_len=8)
    assert "dspark-sla" in POLICIES and EngineConfig().spec_policy in POLICIES


def _engine_names(field: str) -> set[str]:
    """The values the engine itself accepts for ``field``."""
    if field == "dtype":
        from runtime.engine.llm_engine import DTYPES

        return {"auto", *DTYPES}
    if field == "spec_method":  # the speculator checks against this same tuple (runtime/config.py)
        from runtime.speculation.speculator import SPEC_METHODS

        return {"auto", *SPEC_METHODS}  # "auto": resolved by the engine (resolve_spec_method)
    from runtime.speculation.budget import POLICIES, schedule

    # the policies the budget really dispatches (a name in POLICIES without a branch raises)
    return {p for p in POLICIES if schedule(p, [[0.5]], lambda B: 100.0 / B).policy == p}


@pytest.mark.parametrize("field, env, bad, valid", [
    ("dtype", "SPARKGATE_DTYPE", "int3", "gguf"),
    ("spec_method", "SPARKGATE_SPEC_METHOD", "dsaprk", "hybrid"),
    ("spec_policy", "SPARKGATE_SPEC_POLICY", "dsaprk", "threshold"),
])
def test_settings_accept_exactly_the_engine_values(monkeypatch, field, env, bad, valid):
    """``SPARKGATE_DTYPE`` / ``_SPEC_METHOD`` / ``_SPEC_POLICY`` are checked when the settings
    load (a typo fails there, naming the setting, not later inside the engine's start with
    /readyz left at 503) against the same names the engine accepts: a Literal in Settings,
    the engine's own list or dict beside it; this keeps the two equal."""
    import typing

    from pydantic import ValidationError

    from gateway.core.config import Settings

    assert set(typing.get_args(Settings.model_fields[field].annotation)) == _engine_names(field)
    # the same defaults, except the method: the server speculates where it pays ("auto"),
    # the engine as a library decodes plainly unless told to
    expected = "auto" if field == "spec_method" else getattr(EngineConfig(), field)
    assert Settings.model_fields[field].default == expected
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValidationError, match=field):
        Settings(_env_file=None)
    monkeypatch.setenv(env, valid)
    assert getattr(Settings(_env_file=None).engine_config(), field) == valid


@pytest.mark.model
def test_engine_resolves_auto_to_the_cpu_dtype(target_fp32, tokenizer):
    """The default ``dtype="auto"`` reaches the engine unresolved (Settings → EngineConfig);
    the engine must resolve it, not reject it (``make serve`` runs with the default)."""
    from gateway.core.config import Settings
    from runtime.engine.llm_engine import LLMEngine

    assert Settings(_env_file=None).engine_config().dtype == "auto"
    e = LLMEngine(EngineConfig(dtype="auto", max_batch_size=1, max_context=64), lambda rid, ev: None,
                  model=target_fp32, tokenizer=tokenizer)
    assert e.config.dtype == resolve_dtype("auto") and e.config.dtype in ("gguf", "bfloat16", "float32")


@pytest.mark.model
def test_engine_resolves_the_servers_auto_spec_method(target_fp32, tokenizer):
    """The server's default ``spec_method="auto"`` reaches the engine unresolved; the engine
    resolves it against its own dtype: an fp32 target decodes plainly on any CPU (and the
    resolved method is what /metrics and the admin UI report)."""
    from gateway.core.config import Settings
    from runtime.engine.llm_engine import LLMEngine

    assert Settings(_env_file=None).engine_config().spec_method == "auto"
    e = LLMEngine(EngineConfig(dtype="float32", spec_method="auto", max_batch_size=1, max_context=64),
                  lambda rid, ev: None, model=target_fp32, tokenizer=tokenizer)
    assert e.config.spec_method == "none" and e.speculator is None


def test_spec_gate_setting_reaches_the_engine_config(monkeypatch):
    """``SPARKGATE_SPEC_GATE`` (default on) → ``EngineConfig.spec_gate``."""
    from gateway.core.config import Settings

    monkeypatch.delenv("SPARKGATE_SPEC_GATE", raising=False)
    assert EngineConfig().spec_gate is True and Settings(_env_file=None).engine_config().spec_gate is True
    monkeypatch.setenv("SPARKGATE_SPEC_GATE", "false")
    assert Settings(_env_file=None).engine_config().spec_gate is False


@pytest.mark.model
def test_engine_builds_the_gate_only_when_speculating_with_it_on(target_fp32, tokenizer):
    from runtime.speculation.gate import SpecGate
    from runtime.engine.llm_engine import LLMEngine

    def engine(**cfg):
        return LLMEngine(EngineConfig(dtype="float32", max_batch_size=1, max_context=64, **cfg), lambda rid, ev: None,
                         model=target_fp32, tokenizer=tokenizer)

    def gate(**cfg):
        return engine(**cfg).gate

    assert isinstance(gate(spec_method="prompt_lookup"), SpecGate)
    assert gate(spec_method="prompt_lookup", spec_gate=False) is None
    assert gate(spec_method="none") is None
    # dspark: spec_gate on → the budget decides before drafting (no gate); off → every step drafts
    on, off = engine(spec_method="dspark"), engine(spec_method="dspark", spec_gate=False)
    assert on.gate is None and on.speculator.decides_drafting
    assert off.gate is None and not off.speculator.decides_drafting


@pytest.mark.model
def test_auto_decodes_plainly_where_the_gguf_kernel_did_not_build(target_fp32, tokenizer, monkeypatch):
    """On an AMX CPU without a compiler the target falls back to dequantised weights, where
    verified rows are not cheap: ``auto`` then means plain decoding, not the hybrid."""
    from runtime.engine import llm_engine

    monkeypatch.setattr(llm_engine, "resolve_spec_method", lambda name, dtype: "hybrid")  # an AMX CPU's answer
    monkeypatch.setattr(llm_engine.gguf_cpu, "kernel_available", lambda: False)
    e = llm_engine.LLMEngine(EngineConfig(dtype="float32", spec_method="auto", max_batch_size=1, max_context=64),
                             lambda rid, ev: None, model=target_fp32, tokenizer=tokenizer)
    assert e.config.spec_method == "none" and e.speculator is None
