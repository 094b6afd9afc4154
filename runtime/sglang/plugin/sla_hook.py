"""SLA weights inside SGLang 0.5.23's DSpark verify scheduler (runs in SGLang's processes).

Stdlib only, and it imports nothing from ``runtime`` as a package: the weight function is
loaded from the file ``runtime/speculation/sla.py`` (the module the embedded scheduler uses)
by path, so this works in SGLang's own Python environment without torch-free shims.
The ``.pth`` installer (:mod:`runtime.sglang.plugin.install`) loads this file the same
way at interpreter start-up, so the patch is active in every process SGLang spawns
(its scheduler runs in ``multiprocessing`` *spawn* children, ``srt/entrypoints/engine.py``).

What SGLang does (0.5.23)
-------------------------
``srt/speculative/dspark_components/dspark_planner.py``: one global verification budget
K per decode step (``HostConfidenceBudgetPlanner.compute_budget``: lagged confidences +
SPS table, the paper's Θ = τ*·SPS(B) maximisation, §3.2.2/§5.2), then
``DSparkVerifyPlanner._schedule_verify_lens`` splits K over the batch with
``ScheduleVerifyLensTopk.execute`` (``kernels/ops/speculative/dspark/dspark_schedule.py``):
the K draft positions with the largest survival a_{r,j} = Π_{i≤j} c_{r,i} are verified
(value-independent order: survival desc, then position, then row), every request keeps
its anchor (min verify length 1).

What this plugin changes
------------------------
K is left alone (the throughput-optimal budget). The split ranks w_r·a_{r,j} instead of
a_{r,j}, with w_r = ``runtime.speculation.sla.sla_weight(target_r, measured_r, max_weight=cap_r,
sharpness, unknown_weight)`` — the same function as the embedded ``dspark-sla`` policy.
Implementation: column 0 of a *copy* of the confidence tensor (shape ``[bs, γ]``, any
float dtype, any device) is multiplied by w_r; ``cumprod`` then gives w_r·a_{r,j} for
every j, so both SGLang code paths (torch argsort on CPU, Triton kernel on CUDA) rank by
the weighted survival without any change to their code. The confidences used for the
budget K, for acceptance and for metrics are untouched.

Losslessness: w_r is computed before the step from r's past decode speed (never from
this step's drafts), and for fixed r the weighted values w_r·a_{r,j} are still
non-increasing in j, so the value-independent order still admits each request's drafts
as a prefix — the stopping-time argument of :mod:`runtime.speculation.budget` holds.
Caveat: SGLang drops candidates with survival < ``survival_eps`` (1e-6); the test now
sees w_r·a, so a candidate with a ∈ [1e-6/w_r, 1e-6) becomes eligible (immaterial).

Patch points (checked against the 0.5.23 wheel by ``tests/runtime/sglang/test_plugin.py``):

1. ``sglang.srt.speculative.dspark_components.dspark_worker_v2.DSparkWorkerV2.
   _forward_decode(self, batch, on_publish, grammar_barrier=None, coordination_plan=None)``:
   wrapped to compute this step's weights from ``batch.reqs`` (same row order as
   ``batch.req_pool_indices``) and expose them (thread-local) for the duration of the call.
2. ``sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner.
   _schedule_verify_lens(self, *, req_pool_indices, prefix_lens, device, confidence,
   budget)`` (called synchronously from 1.): wrapped to pass the weighted confidence copy.

3. ``sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments(self)``
   (the HTTP process, first call of ``TokenizerManager.generate_request``): wrapped to move
   the two SLA keys from the request's ``custom_labels`` into ``sampling_params.custom_params``
   (:func:`labels_to_custom_params`) — the path for requests that came through sglang-router
   0.3.2, which drops ``custom_params`` but keeps ``custom_labels``. The keys are removed from
   the labels, so they never become Prometheus labels (``collect_metrics``).

Per-request inputs come from ``req.sampling_params.custom_params`` (sent by
:mod:`runtime.sglang.client`): ``sparkgate_sla_target_tokens_per_s`` (float, tok/s) and
``sparkgate_sla_max_weight`` (float ≥ 1). The measured speed is tracked here: tokens
produced since the request was first seen in a decode step, divided by the time since
(≈ the project's (completion − 1)/(t_last − t_first) definition); ``None`` (→
``unknown_weight``) until one more token arrived.

Environment: ``SPARKGATE_SLA_PLUGIN=0`` disables activation; ``SPARKGATE_SLA_SHARPNESS``
(default 3.0) and ``SPARKGATE_SLA_UNKNOWN_WEIGHT`` (default 1.0) tune ``sla_weight``.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

log = logging.getLogger("sparkgate.sla_plugin")

TARGET_KEY = "sparkgate_sla_target_tokens_per_s"
MAX_WEIGHT_KEY = "sparkgate_sla_max_weight"
#: The plugin's variables, read in the SGLang servers' processes by this module only
#: (and the boot file's on/off check, ``install.py``): name → (default, meaning).
ENV = {
    "SPARKGATE_SLA_PLUGIN": ("1", "``0`` disables the SGLang SLA plugin (``runtime/sglang/plugin``)."),
    "SPARKGATE_SLA_SHARPNESS": (3.0, "the SLA plugin's ``sharpness`` of ``runtime.speculation.sla.sla_weight``."),
    "SPARKGATE_SLA_UNKNOWN_WEIGHT": (1.0, "the SLA plugin's weight of a request not measured yet."),
}
ENV_ENABLE, ENV_SHARPNESS, ENV_UNKNOWN_WEIGHT = ENV

WORKER_MODULE = "sglang.srt.speculative.dspark_components.dspark_worker_v2"
WORKER_CLASS = "DSparkWorkerV2"
WORKER_METHOD = "_forward_decode"
PLANNER_MODULE = "sglang.srt.speculative.dspark_components.dspark_planner"
PLANNER_CLASS = "DSparkVerifyPlanner"
PLANNER_METHOD = "_schedule_verify_lens"
#: keyword-only parameters the planner method must have (0.5.23 signature)
PLANNER_KWARGS = ("req_pool_indices", "prefix_lens", "device", "confidence", "budget")
INPUT_MODULE = "sglang.srt.managers.io_struct"
INPUT_CLASS = "GenerateReqInput"
INPUT_METHOD = "normalize_batch_and_arguments"

SLA_FILE = Path(__file__).resolve().parents[2] / "speculation" / "sla.py"
_PATCHED = "__sparkgate_sla_patched__"


def _load_sla():
    """The ``runtime/speculation/sla.py`` module: the already-imported one if it is that file,
    else the file loaded by path under the private name ``_sparkgate_sla``."""
    existing = sys.modules.get("runtime.speculation.sla")
    if existing is not None and Path(getattr(existing, "__file__", "")).resolve() == SLA_FILE:
        return existing
    existing = sys.modules.get("_sparkgate_sla")
    if existing is not None:
        return existing
    spec = importlib.util.spec_from_file_location("_sparkgate_sla", SLA_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the SLA weight function from {SLA_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["_sparkgate_sla"] = module
    spec.loader.exec_module(module)
    return module


_sla = _load_sla()
sla_weight = _sla.sla_weight
DEFAULT_MAX_WEIGHT: float = _sla.DEFAULT_MAX_WEIGHT

#: injectable clock (seconds, monotonic); tests replace it
CLOCK: Callable[[], float] = time.monotonic


def _env_float(name: str) -> float:
    """``$name`` (a key of :data:`ENV`) as a float; unset or not a number → its default."""
    try:
        return float(os.environ.get(name, ENV[name][0]))
    except ValueError:
        return ENV[name][0]


class SpeedTracker:
    """Measured decode speed per request id, from successive observations.

    ``observe(rid, n_tokens, now)`` → tok/s = (n − n₀)/(now − t₀) where (t₀, n₀) is the
    first observation of ``rid``; ``None`` on the first observation or while no new token
    arrived. Entries not observed for ``ttl_s`` seconds are dropped (finished requests).
    """

    def __init__(self, ttl_s: float = 300.0) -> None:
        self.ttl_s = ttl_s
        self._first: dict[str, tuple[float, int]] = {}
        self._last_seen: dict[str, float] = {}
        self._calls = 0

    def __len__(self) -> int:
        return len(self._first)

    def observe(self, rid: str, n_tokens: int, now: float) -> float | None:
        self._last_seen[rid] = now
        first = self._first.get(rid)
        if first is None:
            self._first[rid] = (now, n_tokens)
            return None
        t0, n0 = first
        if n_tokens <= n0 or now <= t0:
            return None
        return (n_tokens - n0) / (now - t0)

    def gc(self, now: float) -> None:
        self._calls += 1
        if self._calls % 256:
            return
        stale = [rid for rid, t in self._last_seen.items() if now - t > self.ttl_s]
        for rid in stale:
            self._first.pop(rid, None)
            self._last_seen.pop(rid, None)


class SlaWeigher:
    """Per-step weights ``w_r`` for the rows of a decode batch.

    Args:
        sharpness, unknown_weight: passed to ``sla_weight`` (``unknown_weight`` is
            clamped to each request's cap).
    """

    def __init__(self, sharpness: float | None = None, unknown_weight: float | None = None) -> None:
        self.sharpness = _env_float(ENV_SHARPNESS) if sharpness is None else sharpness
        self.unknown_weight = _env_float(ENV_UNKNOWN_WEIGHT) if unknown_weight is None else unknown_weight
        self.tracker = SpeedTracker()

    def weight(self, params: Any, rid: str, n_tokens: int, now: float) -> float:
        """``w`` of one request from its ``custom_params`` dict (1.0 without a target or on
        invalid values)."""
        if not isinstance(params, dict):
            return 1.0
        target = params.get(TARGET_KEY)
        if target is None:
            return 1.0
        measured = self.tracker.observe(rid, n_tokens, now)
        try:
            cap = float(params.get(MAX_WEIGHT_KEY, DEFAULT_MAX_WEIGHT))
            unknown = min(max(self.unknown_weight, 1.0), cap)
            return float(sla_weight(float(target), measured, max_weight=cap,
                                    sharpness=self.sharpness, unknown_weight=unknown))
        except (TypeError, ValueError):
            return 1.0

    def step_weights(self, reqs: Sequence[Any] | None) -> list[float] | None:
        """Weights in batch row order, or ``None`` when all are 1 (the unpatched path).

        Reads ``req.rid``, ``len(req.output_ids)`` and ``req.sampling_params.custom_params``
        (SGLang ``Req``, ``srt/managers/schedule_batch.py``)."""
        if not reqs:
            return None
        now = CLOCK()
        weights = []
        for req in reqs:
            params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
            try:
                n_tokens = len(req.output_ids)
            except TypeError:
                n_tokens = 0
            weights.append(self.weight(params, str(getattr(req, "rid", id(req))), n_tokens, now))
        self.tracker.gc(now)
        return weights if any(w != 1.0 for w in weights) else None


WEIGHER = SlaWeigher()
STATS = {"decode_steps": 0, "weighted_steps": 0}
_STATE = threading.local()


def current_step_weights() -> list[float] | None:
    """The weights set by the worker wrapper for the decode step running in this thread."""
    return getattr(_STATE, "weights", None)


def weighted_confidence(confidence: Any, weights: Sequence[float]) -> Any:
    """A copy of ``confidence`` (``[bs, γ]`` tensor) with column 0 scaled by ``weights``
    (one per row), so its cumulative product is w_r·a_{r,j}. Returned unchanged when the
    row count differs (never guess a mapping)."""
    if confidence.dim() != 2 or confidence.shape[0] != len(weights) or confidence.shape[1] == 0:
        return confidence
    scaled = confidence.clone()
    scaled[:, 0].mul_(_weights_like(confidence, weights))
    return scaled


def _weights_like(like: Any, weights: Sequence[float]) -> Any:
    """``weights`` as a 1-D tensor of ``like``'s dtype on ``like``'s device. On CUDA the
    copy goes through pinned host memory with ``non_blocking=True``: a plain
    ``new_tensor`` copies from pageable memory and makes the host wait for the stream
    (all queued GPU work), which would stall SGLang's overlap scheduler every step."""
    if not getattr(like, "is_cuda", False):
        return like.new_tensor(list(weights))
    import torch  # only reached inside SGLang's process, which has torch

    host = torch.tensor(list(weights), dtype=like.dtype, pin_memory=True)
    return host.to(like.device, non_blocking=True)


def _wrap_worker(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _forward_decode(self, *args, **kwargs):
        batch = args[0] if args else kwargs.get("batch")
        previous = getattr(_STATE, "weights", None)
        try:
            _STATE.weights = WEIGHER.step_weights(getattr(batch, "reqs", None))
        except Exception:  # noqa: BLE001 — never break serving over a weight
            log.exception("sparkgate SLA weights failed; this step is unweighted")
            _STATE.weights = None
        STATS["decode_steps"] += 1
        try:
            return orig(self, *args, **kwargs)
        finally:
            _STATE.weights = previous

    setattr(_forward_decode, _PATCHED, True)
    return _forward_decode


def _wrap_planner(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _schedule_verify_lens(self, *args, **kwargs):
        weights = current_step_weights()
        confidence = kwargs.get("confidence")
        if weights is not None and confidence is not None:
            kwargs["confidence"] = weighted_confidence(confidence, weights)
            if kwargs["confidence"] is not confidence:
                if STATS["weighted_steps"] == 0:
                    log.info("sparkgate SLA plugin: first SLA-weighted DSpark verify split")
                STATS["weighted_steps"] += 1
        return orig(self, *args, **kwargs)

    setattr(_schedule_verify_lens, _PATCHED, True)
    return _schedule_verify_lens


def labels_to_custom_params(obj: Any) -> bool:
    """Move :data:`TARGET_KEY` / :data:`MAX_WEIGHT_KEY` from ``obj.custom_labels`` (a
    ``{str: str}`` dict, the values float text) into ``obj.sampling_params``'s
    ``custom_params`` (a dict, or each dict of a list) as floats; values already in
    ``custom_params`` win. The keys leave ``custom_labels`` (``None`` when it becomes empty).
    Returns whether anything moved; a value that is not a number is dropped."""
    labels = getattr(obj, "custom_labels", None)
    if not isinstance(labels, dict) or not any(k in labels for k in (TARGET_KEY, MAX_WEIGHT_KEY)):
        return False
    rest = dict(labels)
    moved: dict[str, float] = {}
    for key in (TARGET_KEY, MAX_WEIGHT_KEY):
        if key in rest:
            try:
                moved[key] = float(rest.pop(key))
            except (TypeError, ValueError):
                pass
    obj.custom_labels = rest or None
    if obj.sampling_params is None:
        obj.sampling_params = {}
    targets = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
    for sp in targets:
        if isinstance(sp, dict):
            params = sp.get("custom_params")
            sp["custom_params"] = {**moved, **params} if isinstance(params, dict) else moved
    return bool(moved)


def _wrap_input(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def normalize_batch_and_arguments(self, *args, **kwargs):
        try:
            labels_to_custom_params(self)
        except Exception:  # noqa: BLE001 — never break a request over its SLA labels
            log.exception("sparkgate SLA plugin: reading the SLA from custom_labels failed")
        return orig(self, *args, **kwargs)

    setattr(normalize_batch_and_arguments, _PATCHED, True)
    return normalize_batch_and_arguments


def _check_planner_signature(fn: Callable) -> bool:
    params = inspect.signature(fn).parameters
    return all(name in params and params[name].kind is inspect.Parameter.KEYWORD_ONLY
               for name in PLANNER_KWARGS)


def _patch_method(module: Any, cls_name: str, method: str, wrap: Callable[[Callable], Callable],
                  check: Callable[[Callable], bool] | None = None) -> bool:
    cls = getattr(module, cls_name, None)
    orig = getattr(cls, "__dict__", {}).get(method) if cls is not None else None
    if orig is None:
        log.warning("sparkgate SLA plugin: %s.%s.%s not found; not patched", module.__name__, cls_name, method)
        return False
    if getattr(orig, _PATCHED, False):
        return True
    if check is not None and not check(orig):
        log.warning("sparkgate SLA plugin: %s.%s.%s has an unexpected signature %s; not patched",
                    module.__name__, cls_name, method, inspect.signature(orig))
        return False
    setattr(cls, method, wrap(orig))
    return True


def patch_worker_module(module: Any) -> bool:
    """Patch point 1 (see module docstring). Idempotent; ``False`` if it is missing."""
    return _patch_method(module, WORKER_CLASS, WORKER_METHOD, _wrap_worker)


def patch_planner_module(module: Any) -> bool:
    """Patch point 2 (see module docstring). Idempotent; ``False`` if it is missing or its
    signature differs from 0.5.23's."""
    return _patch_method(module, PLANNER_CLASS, PLANNER_METHOD, _wrap_planner, _check_planner_signature)


def patch_input_module(module: Any) -> bool:
    """Patch point 3 (see module docstring). Idempotent; ``False`` if it is missing."""
    return _patch_method(module, INPUT_CLASS, INPUT_METHOD, _wrap_input)


PATCHES: dict[str, Callable[[Any], bool]] = {
    WORKER_MODULE: patch_worker_module,
    PLANNER_MODULE: patch_planner_module,
    INPUT_MODULE: patch_input_module,
}


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then applies the patch to the fresh module."""

    def __init__(self, inner: Any, patch: Callable[[Any], bool]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        try:
            self._patch(module)
        except Exception:  # noqa: BLE001 — a failed patch must not break SGLang's import
            log.exception("sparkgate SLA plugin: patching %s failed", module.__name__)

    def __getattr__(self, name: str):  # get_source, get_filename, is_package, …
        return getattr(self._inner, name)


class SlaImportHook(importlib.abc.MetaPathFinder):
    """``sys.meta_path`` finder that patches the SGLang modules of :data:`PATCHES` when they are imported."""

    _sparkgate_sla_finder = True

    def find_spec(self, fullname, path, target=None):
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "_sparkgate_sla_finder", False):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def is_active() -> bool:
    """True when an SLA import hook (from any copy of this module) is on ``sys.meta_path``."""
    return any(getattr(f, "_sparkgate_sla_finder", False) for f in sys.meta_path)


def activate() -> bool:
    """Install the import hook (idempotent) and patch modules already imported.

    Returns ``False`` when disabled by ``SPARKGATE_SLA_PLUGIN=0``."""
    if os.environ.get(ENV_ENABLE, ENV[ENV_ENABLE][0]) == "0":
        return False
    if not is_active():
        sys.meta_path.insert(0, SlaImportHook())
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    return True


def deactivate() -> None:
    """Remove the import hook (already-patched classes stay patched)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "_sparkgate_sla_finder", False)]
