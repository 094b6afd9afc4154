"""The package layout's rules, checked on the import graph read from the source
(tests/support/import_graph.py: every import statement counts, function-level and
``TYPE_CHECKING`` ones included)."""

from __future__ import annotations

import pytest

from tests.support.import_graph import cycles, graph, reachable

G = graph()
LOOP = {"runtime.engine.llm_engine", "runtime.engine.async_engine", "runtime.engine.profile"}


def test_the_graph_is_read():
    # a few known edges, so an empty or broken reader cannot pass the rules below
    assert "runtime.speculation.verifier" in G["runtime.engine.llm_engine"]
    assert "runtime.engine.llm_engine" in G["runtime.engine.profile"]  # the CLI builds an engine
    assert "runtime.models.llama" in G["training.features"]
    assert len([m for m in G if m.startswith("runtime.speculation.")]) >= 15


def test_no_import_cycles():
    assert cycles(G) == []


def test_cycle_detection_finds_a_planted_cycle():
    g = {k: set(v) for k, v in G.items()}
    g["runtime.engine.sampler"].add("runtime.engine.llm_engine")
    assert any({"runtime.engine.sampler", "runtime.engine.llm_engine"} <= set(c) for c in cycles(g))


@pytest.mark.parametrize("forbidden", ["gateway", "training"])
def test_runtime_never_imports_the_gateway_or_the_training_package(forbidden):
    bad = {m: sorted(d for d in deps if d.split(".")[0] == forbidden)
           for m, deps in G.items() if m.split(".")[0] == "runtime"}
    assert {m: d for m, d in bad.items() if d} == {}


def test_speculation_never_reaches_the_engine_loop():
    """The speculation package may use engine parts (sampler, sequence, KV cache) but never
    the loop: the SPS profiler takes a round function instead."""
    reach = {m: sorted(reachable(G, m) & LOOP) for m in G if m.startswith("runtime.speculation")}
    assert {m: r for m, r in reach.items() if r} == {}


@pytest.mark.parametrize("pkg", ["runtime.engine", "runtime.speculation", "runtime.kernels", "training"])
def test_package_inits_import_nothing(pkg):
    """Importing a submodule runs its package's ``__init__``: empty ones keep the rules above true
    at run time too (e.g. ``runtime.engine.sampler`` must not pull in the loop)."""
    assert G[pkg] == set()
