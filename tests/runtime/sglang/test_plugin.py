"""The SGLang SLA plugin: weights from runtime/speculation/sla.py, the confidence scaling, the
.pth installer, and the patch taking effect in a *spawned* child of another Python
environment (as SGLang's scheduler processes are) against fake modules that have the
dotted names and method signatures of sglang 0.5.23 (recorded in test_sglang_source.py,
re-checked against the wheel there)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HOOK_FILE = ROOT / "runtime" / "sglang" / "plugin" / "sla_hook.py"

# -- fake sglang modules (test doubles: names and signatures of 0.5.23, our own bodies) --
FAKE_PLANNER = '''
"""FAKE sglang.srt.speculative.dspark_components.dspark_planner (sparkgate test double).
Only DSparkVerifyPlanner._schedule_verify_lens's name and keyword-only signature match
sglang 0.5.23; the body is a plain top-k split written for the test."""


def topk_split(confidence, budget, survival_eps=1e-6):
    """Verify lengths: 1 (anchor) + number of this row's positions among the `budget`
    largest prefix survivals (order: survival desc, position asc, row asc)."""
    import torch

    surv = torch.cumprod(confidence.to(torch.float32), dim=1)
    n, g = surv.shape
    cands = sorted((-float(surv[r, j]), j, r) for r in range(n) for j in range(g)
                   if float(surv[r, j]) >= survival_eps)
    extra = [0] * n
    for _, _, r in cands[:budget]:
        extra[r] += 1
    return [1 + e for e in extra]


class DSparkVerifyPlanner:
    def _schedule_verify_lens(self, *, req_pool_indices, prefix_lens, device, confidence, budget):
        return topk_split(confidence, budget)
'''

FAKE_WORKER = '''
"""FAKE sglang.srt.speculative.dspark_components.dspark_worker_v2 (sparkgate test double)."""
from sglang.srt.speculative.dspark_components.dspark_planner import DSparkVerifyPlanner


class DSparkWorkerV2:
    def __init__(self):
        self._verify_planner = DSparkVerifyPlanner()

    def _forward_decode(self, batch, on_publish, grammar_barrier=None, coordination_plan=None):
        return self._verify_planner._schedule_verify_lens(
            req_pool_indices=batch.req_pool_indices, prefix_lens=None, device="cpu",
            confidence=batch.confidence, budget=batch.budget)
'''

# two requests: A (tier target 100 tok/s, slow), B (best effort, confident drafts)
CONF_A, CONF_B, BUDGET = 0.6, 0.9, 4
GAMMA = 4


def write_fake_sglang(root: Path) -> Path:
    pkg = root / "sglang" / "srt" / "speculative" / "dspark_components"
    pkg.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", root / "sglang" / "srt" / "speculative", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "dspark_planner.py").write_text(FAKE_PLANNER)
    (pkg / "dspark_worker_v2.py").write_text(FAKE_WORKER)
    return root


def _child(fake_root: str, out) -> None:
    """Runs in the spawned child: two decode steps 1 s apart (fake clock)."""
    import torch

    result = {"active": any(getattr(f, "_sparkgate_sla_finder", False) for f in sys.meta_path)}
    hook = sys.modules.get("sparkgate_sla_hook")
    sys.path.insert(0, fake_root)
    from sglang.srt.speculative.dspark_components import dspark_planner, dspark_worker_v2

    result["patched"] = [
        getattr(dspark_worker_v2.DSparkWorkerV2._forward_decode, "__sparkgate_sla_patched__", False),
        getattr(dspark_planner.DSparkVerifyPlanner._schedule_verify_lens, "__sparkgate_sla_patched__", False),
    ]
    now = [0.0]
    if hook is not None:
        hook.CLOCK = lambda: now[0]
        result["sla_file"] = hook.sla_weight.__code__.co_filename
    conf = torch.tensor([[CONF_A] * GAMMA, [CONF_B] * GAMMA, [CONF_B] * GAMMA])

    def req(rid, n, params):
        return types.SimpleNamespace(rid=rid, output_ids=list(range(n)),
                                     sampling_params=types.SimpleNamespace(custom_params=params))

    worker = dspark_worker_v2.DSparkWorkerV2()
    lens = []
    for t, n_a in ((0.0, 1), (1.0, 11)):  # A: 10 tokens in 1 s = 10 tok/s against 100
        now[0] = t
        batch = types.SimpleNamespace(
            reqs=[req("A", n_a, {"sparkgate_sla_target_tokens_per_s": 100.0, "sparkgate_sla_max_weight": 4.0}),
                  req("B", 5 * n_a, None),
                  req("C", n_a, {"sparkgate_sla_target_tokens_per_s": "not a number"})],
            req_pool_indices=torch.tensor([7, 3, 5]), confidence=conf.clone(), budget=BUDGET)
        lens.append(worker._forward_decode(batch, on_publish=None))
        result.setdefault("conf_untouched", []).append(bool(torch.equal(batch.confidence, conf)))
    result["lens"] = lens
    result["stats"] = dict(hook.STATS) if hook is not None else None
    out.put(result)


def _run_child(executable: str | None, fake_root: Path) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    if executable is not None:
        ctx.set_executable(executable)
    try:
        p = ctx.Process(target=_child, args=(str(fake_root), q))
        p.start()
        result = q.get(timeout=120)
        p.join(30)
    finally:
        ctx.set_executable(sys.executable)
    assert p.exitcode == 0
    return result


def _expected_lens(weights: list[float]) -> list[int]:
    """The split the plugin should produce: top-BUDGET of w_r·a_{r,j}, independently computed."""
    rows = [CONF_A, CONF_B, CONF_B]
    cands = sorted((-(w * c ** (j + 1)), j, r) for r, (w, c) in enumerate(zip(weights, rows)) for j in range(GAMMA))
    extra = [0, 0, 0]
    for _, _, r in cands[:BUDGET]:
        extra[r] += 1
    return [1 + e for e in extra]


@pytest.fixture(scope="module")
def sglang_env(tmp_path_factory):
    """A separate Python environment ("SGLang's") with the plugin installed via the .pth."""
    from runtime.sglang.plugin import install

    env = tmp_path_factory.mktemp("sglang-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = str(env / "bin" / "python")
    site = install.site_packages_of(python)
    written = install.install(site)
    assert [p.name for p in written] == ["sparkgate_sla_boot.py", "sparkgate_sla_plugin.pth"]
    assert (site / "sparkgate_sla_plugin.pth").read_text() == "import sparkgate_sla_boot\n"
    return python, site


@pytest.mark.slow
def test_patch_applies_in_spawned_child_and_weights_the_split(sglang_env, tmp_path):
    from runtime.speculation.sla import sla_weight

    python, _ = sglang_env
    res = _run_child(python, write_fake_sglang(tmp_path / "fake"))
    assert res["active"] and res["patched"] == [True, True]
    assert Path(res["sla_file"]) == ROOT / "runtime" / "speculation" / "sla.py"  # the embedded scheduler's
    w_a = sla_weight(100.0, 10.0, max_weight=4.0)
    assert w_a == pytest.approx(1 + 3 * (1 - math.exp(-2.7)) / (1 - math.exp(-3)))
    unweighted = _expected_lens([1.0, 1.0, 1.0])
    assert unweighted == [1, 3, 3]  # B and C (0.9, 0.81) take the whole budget
    # step 1: A not measured yet (unknown_weight 1) → SGLang's own split
    # step 2: A at 10 tok/s of 100 → w_A ≈ 3.95 → A's first two drafts (2.37, 1.42) beat B, C (0.9)
    assert res["lens"] == [unweighted, _expected_lens([w_a, 1.0, 1.0])] == [[1, 3, 3], [3, 2, 2]]
    assert res["stats"] == {"decode_steps": 2, "weighted_steps": 1}
    assert res["conf_untouched"] == [True, True]  # the scheduler got a copy


@pytest.mark.slow
def test_without_the_pth_the_split_is_sglangs(tmp_path):
    res = _run_child(None, write_fake_sglang(tmp_path / "fake"))
    assert not res["active"] and res["patched"] == [False, False]
    assert res["lens"] == [[1, 3, 3], [1, 3, 3]]


def test_disabled_by_environment(sglang_env, tmp_path):
    python, _ = sglang_env
    fake = write_fake_sglang(tmp_path / "fake")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(fake)!r})
        import sglang.srt.speculative.dspark_components.dspark_planner as p
        print(getattr(p.DSparkVerifyPlanner._schedule_verify_lens, "__sparkgate_sla_patched__", False),
              "sparkgate_sla_hook" in sys.modules)
    """)
    env_on = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    env_off = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                             env={"SPARKGATE_SLA_PLUGIN": "0", "PATH": "/usr/bin:/bin"})
    assert env_on.stdout.split() == ["True", "True"], env_on.stderr
    assert env_off.stdout.split() == ["False", "False"], env_off.stderr


def test_hook_is_stdlib_only():
    code = textwrap.dedent(f"""
        import importlib.util, sys
        s = importlib.util.spec_from_file_location("h", {str(HOOK_FILE)!r})
        m = importlib.util.module_from_spec(s); s.loader.exec_module(m)
        heavy = sorted(n for n in sys.modules if n.split(".")[0] in
                       ("torch", "numpy", "httpx", "transformers", "runtime", "gateway", "sglang"))
        print(heavy, m.sla_weight(10.0, 0.0, max_weight=4.0))
    """)
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[]", "4.0"]


def test_weighted_confidence_scales_every_prefix_survival():
    import torch

    from runtime.sglang.plugin.sla_hook import weighted_confidence

    conf = torch.tensor([[0.5, 0.8, 0.9], [0.9, 0.5, 0.1]])
    scaled = weighted_confidence(conf, [3.0, 1.0])
    assert torch.allclose(torch.cumprod(scaled, 1), torch.cumprod(conf, 1) * torch.tensor([[3.0], [1.0]]))
    assert torch.equal(conf, torch.tensor([[0.5, 0.8, 0.9], [0.9, 0.5, 0.1]]))  # input untouched
    assert weighted_confidence(conf, [2.0]) is conf  # row count mismatch: left alone


def test_weigher_uses_sla_weight_and_tracks_speed():
    from runtime.speculation.sla import sla_weight
    from runtime.sglang.plugin import sla_hook

    w = sla_hook.SlaWeigher(sharpness=0.0, unknown_weight=2.0)

    def req(rid, n, params):
        return types.SimpleNamespace(rid=rid, output_ids=[0] * n,
                                     sampling_params=types.SimpleNamespace(custom_params=params))

    p = {"sparkgate_sla_target_tokens_per_s": 50.0, "sparkgate_sla_max_weight": 3.0}
    clock = iter([0.0, 2.0])
    old = sla_hook.CLOCK
    sla_hook.CLOCK = lambda: next(clock)
    try:
        assert w.step_weights([req("a", 3, p), req("b", 1, None)]) == [2.0, 1.0]  # unknown → 2.0
        got = w.step_weights([req("a", 53, p), req("b", 9, None)])  # 50 tokens / 2 s = 25 tok/s
    finally:
        sla_hook.CLOCK = old
    assert got == [pytest.approx(sla_weight(50.0, 25.0, max_weight=3.0, sharpness=0.0)), 1.0]
    assert got[0] == pytest.approx(2.0)  # linear: deficit 0.5 → 1 + 2·0.5
    assert w.step_weights([req("z", 1, None)]) is None  # all 1 → SGLang's unpatched path


def test_planner_with_another_signature_is_not_patched():
    from runtime.sglang.plugin import sla_hook

    class DSparkVerifyPlanner:
        def _schedule_verify_lens(self, confidence, budget):  # positional: not 0.5.23's
            return None

    module = types.SimpleNamespace(__name__="fake", DSparkVerifyPlanner=DSparkVerifyPlanner)
    assert sla_hook.patch_planner_module(module) is False
    assert not hasattr(DSparkVerifyPlanner._schedule_verify_lens, "__sparkgate_sla_patched__")


def test_uninstall(tmp_path):
    from runtime.sglang.plugin import install

    install.install(tmp_path)
    assert install.is_installed(tmp_path)
    boot = (tmp_path / install.BOOT_NAME).read_text()
    assert repr(str(HOOK_FILE)) in boot
    assert [p.name for p in install.uninstall(tmp_path)] == [install.PTH_NAME, install.BOOT_NAME]
    assert not install.is_installed(tmp_path)
    with pytest.raises(FileNotFoundError):
        install.install(tmp_path / "missing")


FAKE_IO_STRUCT = '''
"""FAKE sglang.srt.managers.io_struct (sparkgate test double): GenerateReqInput's field names
and normalize_batch_and_arguments(self) as in sglang 0.5.23; the body only records its input."""
from dataclasses import dataclass


@dataclass
class GenerateReqInput:
    sampling_params: object = None
    custom_labels: object = None
    seen: object = None

    def normalize_batch_and_arguments(self):
        self.seen = (self.sampling_params, self.custom_labels)
'''


def test_sla_labels_from_the_router_become_custom_params(sglang_env, tmp_path):
    """Patch point 3 in an interpreter with the .pth: the SLA keys that came in ``custom_labels``
    (the path through sglang-router 0.3.2) are in ``sampling_params.custom_params`` when SGLang's
    ``normalize_batch_and_arguments`` runs, and no longer labels; other labels stay."""
    python, _ = sglang_env
    pkg = tmp_path / "fake" / "sglang" / "srt" / "managers"
    pkg.mkdir(parents=True)
    for d in (pkg.parents[1], pkg.parent, pkg):
        (d / "__init__.py").write_text("")
    (pkg / "io_struct.py").write_text(FAKE_IO_STRUCT)
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(tmp_path / "fake")!r})
        from sglang.srt.managers.io_struct import GenerateReqInput
        a = GenerateReqInput({{"max_new_tokens": 4}}, {{"sparkgate_sla_target_tokens_per_s": "5.0",
                             "sparkgate_sla_max_weight": "2.5", "team": "x"}})
        a.normalize_batch_and_arguments()
        b = GenerateReqInput([{{}}, {{"custom_params": {{"sparkgate_sla_max_weight": 3.0}}}}],
                             {{"sparkgate_sla_target_tokens_per_s": "7"}})
        b.normalize_batch_and_arguments()
        c = GenerateReqInput({{"max_new_tokens": 4}}, {{"team": "y"}})
        c.normalize_batch_and_arguments()
        print(json.dumps([a.seen, b.seen, c.seen]))
    """)
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    a, b, c = json.loads(out.stdout)
    assert a == [{"max_new_tokens": 4, "custom_params": {"sparkgate_sla_target_tokens_per_s": 5.0,
                                                          "sparkgate_sla_max_weight": 2.5}}, {"team": "x"}]
    assert b == [[{"custom_params": {"sparkgate_sla_target_tokens_per_s": 7.0}},
                  {"custom_params": {"sparkgate_sla_target_tokens_per_s": 7.0, "sparkgate_sla_max_weight": 3.0}}],
                 None]
    assert c == [{"max_new_tokens": 4}, {"team": "y"}]  # untouched without SLA labels
