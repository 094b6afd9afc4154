"""The SPS table's profiler: time full speculative rounds, key and cache the result on disk.

Paper §3.2.2: the hardware-aware scheduler (:mod:`runtime.speculation.budget`) needs
SPS(B) — full engine rounds per second when the target verifies B tokens in one
forward — and DSpark profiles it once at start-up. This module supplies

* :class:`EngineRoundFn` — ``round_fn(B, ctx_len) -> seconds``: the verification part
  of one round of THIS engine (its model, dtype, device, thread count, drafter and KV
  caches): the target's ragged verification forward over B tokens (with the drafter's tap
  layers), :func:`runtime.speculation.verifier.spec_round` (warp + accept/resample at the
  table's temperature) and the drafter-context commit of the anchor + accepted rows. The
  draft itself is NOT timed: when the budget decides ℓ_r the drafts exist already, so
  their cost is sunk and only what B changes may weigh on ℓ (a drafting cost inside every
  B would make each verified row look cheaper than it is). Not included either:
  detokenisation / stop checks and the scheduler call itself (≈0.04 ms at batch 16).
  Two tables are profiled: T = 1 (sampled rows warp 49,152-way distributions) and T = 0
  (greedy rows: argmax only), since a verified row costs less in a greedy batch.
  The B tokens are spread over the fewest requests that can hold them,
  r = ⌈B / (1+γ)⌉, with ℓ_r as equal as possible (e.g. γ = 7: B = 1 → one request,
  ℓ = 0; B = 8 → one request, ℓ = 7; B = 128 → 16 requests, ℓ = 7 each);
  every request's context is ``ctx_len`` tokens (zero-filled K/V: attention costs
  the same whatever the values).
* :func:`sps_cache_key` — everything that changes the timings: model, dtype,
  device (+ CPU model), torch threads, torch version, γ, drafter id (the drafter's
  architecture: layers, Markov rank/variant, block size, taps — timings do not
  depend on the weights), the largest B profiled, and an engine version (a hash of
  the runtime package's sources, so editing the engine or its kernels invalidates old profiles).
* :func:`initial_sps_table` — what :class:`runtime.speculation.speculator.Speculator` starts
  with: ``EngineConfig.sps_table_path`` if set, else a cached profile matching the
  key, else :func:`runtime.speculation.sps.fallback_table` (never profiles).
* :func:`ensure_profiled` — called by :class:`runtime.engine.llm_engine.LLMEngine` at start-up
  when ``EngineConfig.profile_on_start`` is true: keep a loaded profile, else
  profile now (≈ buckets × contexts × (warm-up + repeats) rounds; on the 2-core CPU
  with the defaults at `max_batch_size` 16, γ = 4: 22 buckets × 2 contexts × (2 + 7) = 396 rounds per
  temperature, 65–83 s in fp32 on the 2-core Zen 3 EPYC) and cache it.
The profiler takes a round function; it never imports the engine loop.
:mod:`runtime.engine.profile` builds the engine's round function, profiles an idle
engine at start-up (``ensure_profiled``) and is the ``sparkgate profile`` command.

Smoothing / monotonisation is :class:`runtime.speculation.sps.SpsTable`'s: median of the
repeats per cell (the cells' rounds interleaved, :func:`runtime.speculation.sps.profile`),
running minimum of SPS along B and along context length; lookups interpolate the round
time linearly. B·SPS(B) is NOT made non-decreasing in a profiled table (see
:func:`profile_table`): a round's cost steps up at some row counts, and the budget must see it.

Cache location: ``runtime.config.cache_dir() / "sps"`` (i.e.
``$SPARKGATE_CACHE_DIR/sps``), one ``sps-<hash(key)>.json`` per key.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from runtime.config import cache_dir
from runtime.engine.sampler import SamplingBatch
from runtime.models.llama import SeqSpan
from runtime.models.loader import MODEL_NAME
from runtime.speculation import sps as sps_mod
from runtime.speculation.sps import SpsTable
from runtime.speculation.verifier import spec_round

if TYPE_CHECKING:  # pragma: no cover
    from runtime.config import EngineConfig
    from runtime.engine.kv_cache import KVCache
    from runtime.models.llama import LlamaModel
    from runtime.speculation.speculator import Speculator

log = logging.getLogger(__name__)

__all__ = [
    "PROFILE_VERSION",
    "DENSE_BUCKETS",
    "DEFAULT_CONTEXT_LENS",
    "EngineRoundFn",
    "split_budget",
    "profile_buckets",
    "profile_context_lens",
    "engine_version",
    "drafter_id",
    "sps_cache_dir",
    "sps_cache_key",
    "make_round_fn",
    "ensure_profiled",
    "initial_sps_table",
    "profile_table",
    "other_cpu_load",
    "BUSY_CORES_LIMIT",
]

#: Bump when the meaning of a profiled round changes (what round_fn times).
PROFILE_VERSION = 3
#: Context lengths (tokens) profiled by default (clipped to the engine's max context).
DEFAULT_CONTEXT_LENS: tuple[int, ...] = (256, 1024)
DEFAULT_REPEATS = 7
DEFAULT_WARMUP = 2
#: Seconds of untimed rounds (smallest and largest B in turn) before the first timed cell.
GLOBAL_WARMUP_S = 0.5
#: Temperatures with a table of their own: sampled (1.0) and greedy (0.0) batches.
PROFILE_TEMPERATURES = (1.0, 0.0)
#: Mean CPU (in cores) that OTHER processes may use while a profile runs before its table is
#: used for this run only, not cached (:func:`other_cpu_load`).
BUSY_CORES_LIMIT = 0.5

_ROOT = Path(__file__).resolve().parents[2]  # the repository
#: Sources whose code runs inside a profiled round, whose hash is the engine version: every
#: Python and C++ source of the runtime package. (A hand-kept list of files went stale: it
#: missed the gguf kernel and its Python side, so a kernel change kept cached tables.)
_HOT_PATH_SUFFIXES = (".py", ".cpp", ".h")


def _hot_path() -> list[str]:
    """The runtime package's sources, repository-relative, sorted."""
    return sorted(str(p.relative_to(_ROOT)) for p in (_ROOT / "runtime").rglob("*")
                  if p.suffix in _HOT_PATH_SUFFIXES and p.is_file())


def other_cpu_load() -> Callable[[], float]:
    """Start measuring the CPU that processes other than this one use. Returns a function
    giving their mean load in cores since the start: busy time of the whole machine from
    ``/proc/stat`` (user, nice, system, irq, softirq, steal: a VM's stolen time slows a profile
    too) minus this process's own CPU time (``os.times``, all threads), per wall second.
    Returns 0 where ``/proc/stat`` cannot be read.

    Why: on the 2-core Ice Lake Xeon a profile taken while another process ran for a minute
    priced 2 verified rows at 75 ms against 42 ms on an idle machine; cached, the table kept
    the hybrid at 95–99 % plain rounds on every later start (docs/benchmarks.md, "Packed fp32
    weights"), and measured round costs (live_cost.py) cannot correct rows never drafted."""

    def busy_seconds() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu":
            return None
        ticks = [int(x) for x in fields[1:9]] + [0] * 8
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    def own_seconds() -> float:
        t = os.times()
        return t.user + t.system

    wall0, busy0, own0 = time.perf_counter(), busy_seconds(), own_seconds()

    def load() -> float:
        busy, wall = busy_seconds(), time.perf_counter() - wall0
        if busy is None or busy0 is None or wall <= 0:
            return 0.0
        return max(0.0, (busy - busy0) - (own_seconds() - own0)) / wall

    return load


# ------------------------------------------------------------------ geometry
def split_budget(B: int, gamma: int) -> list[int]:
    """ℓ_r per request for B verification tokens: r = ⌈B/(1+γ)⌉ requests, Σ(1+ℓ_r) = B.

    Args:
        B: verification tokens (≥ 1).
        gamma: drafted block size γ (≥ 0).

    Returns:
        ℓ_r, each in ``[0, γ]``, as equal as possible (larger ones first).

    Raises:
        ValueError: ``B < 1`` or ``gamma < 0``.
    """
    if B < 1 or gamma < 0:
        raise ValueError(f"need B >= 1 and gamma >= 0, got B={B}, gamma={gamma}")
    r = -(-B // (1 + gamma))
    q, rem = divmod(B, r)
    return [q - 1 + (1 if i < rem else 0) for i in range(r)]


#: Every verified-row count up to this one is a bucket of its own (see :func:`profile_buckets`).
DENSE_BUCKETS = 16


def profile_buckets(max_requests: int, gamma: int) -> list[int]:
    """Every B from 1 to :data:`DENSE_BUCKETS`, then 17, 24, 32, 48, 64, 96, 128, … (powers of
    two and the midpoints between them) below the largest possible B = max_requests·(1+γ),
    then that B: e.g. 16 requests, γ = 7 → 1, 2, …, 16, 17, 24, 32, 48, 64, 96, 128.

    A round's cost is a step function of its rows at small B, which interpolating between
    powers of two hides: on the AVX2 EPYC (fp32, MKL) 4 rows cost about 1 row but 5 rows
    +28–50 % (bench/round_shapes.py; served c = 4 rounds with one n-gram row: 105.6 vs 67.2 ms,
    where a 1/2/4/8 table interpolated +6 %), and 16 rows cost less than 10–15 unpadded.
    17 catches the step past 16 rows (a batch of 16 plus one draft)."""
    top = max(1, max_requests * (1 + gamma))
    out = list(range(1, min(top, DENSE_BUCKETS) + 1))
    b = DENSE_BUCKETS
    extra = [DENSE_BUCKETS + 1]
    while b < top:
        extra += [b + b // 2, 2 * b]
        b *= 2
    out += [x for x in extra if out[-1] < x < top]
    if out[-1] != top:
        out.append(top)
    return out


def profile_context_lens(max_context: int, gamma: int, wanted: Sequence[int] = DEFAULT_CONTEXT_LENS) -> list[int]:
    """``wanted`` clipped to what fits a KV slot (``max_context − γ − 2``), deduplicated."""
    cap = max(1, max_context - gamma - 2)
    return sorted({min(int(c), cap) for c in wanted})


# -------------------------------------------------------------- round timing
class EngineRoundFn:
    """``round_fn(B, ctx_len) -> seconds`` for :func:`runtime.speculation.sps.profile`.

    Times one full round of the engine's own components (module docstring) in its
    serving dtype, device and thread count. Uses free slots of the given target KV
    cache and the speculator's draft context cache and returns them as found
    (lengths reset, slots freed), so it can run inside a freshly built engine before
    any request arrives.

    Args:
        model: the target model.
        speculator: the engine's speculator (drafter + draft context cache, γ).
        cache: the engine's target KV cache; needs ``⌈B_max/(1+γ)⌉`` free slots and
            ``max_len ≥ ctx_len + γ + 1``.
        temperature: sampling temperature of the timed rounds (1.0: the OpenAI default;
            0 would time the cheaper greedy warp).
        seed: seed of the random anchors/drafts (timings do not depend on values).
    """

    def __init__(
        self, model: "LlamaModel", speculator: "Speculator", cache: "KVCache", *, temperature: float = 1.0, seed: int = 0
    ) -> None:
        self.model = model
        self.spec = speculator
        self.cache = cache
        self.gamma = speculator.gamma
        self.temperature = float(temperature)
        self.rng = random.Random(seed)
        self.calls = 0

    def __call__(self, B: int, ctx_len: int) -> float:
        return self.time_round(split_budget(int(B), self.gamma), ctx_len)

    def time_round(self, lengths: Sequence[int], ctx_len: int) -> float:
        """Seconds of one round verifying ``len(lengths)`` requests with ``lengths[r]`` drafts
        each (each ≤ γ), every context ``ctx_len`` tokens (bench/round_shapes.py times served shapes)."""
        lengths = [int(l) for l in lengths]
        if not lengths or min(lengths) < 0 or max(lengths) > self.gamma:
            raise ValueError(f"need 1+ requests with 0..γ={self.gamma} drafts each, got {lengths}")
        r = len(lengths)
        if self.cache.num_free < r:
            raise ValueError(f"{r} requests need {r} free KV slots, {self.cache.num_free} free")
        if ctx_len + self.gamma + 1 > self.cache.max_len:
            raise ValueError(f"ctx_len {ctx_len} + γ + 1 exceeds the KV slot ({self.cache.max_len})")
        V = self.model.cfg.vocab_size
        slots = [self.cache.allocate() for _ in range(r)]
        spec, drafter, dcache = self.spec, self.spec.drafter, self.spec.dcache
        gens = [torch.Generator().manual_seed(self.rng.getrandbits(62)) for _ in range(r)]
        sampling = SamplingBatch(torch.full((r,), self.temperature), torch.zeros(r, dtype=torch.long), torch.ones(r), gens)
        anchors = torch.tensor([self.rng.randrange(V) for _ in range(r)], dtype=torch.long)
        try:
            for s in slots:
                self.cache.lengths[s] = ctx_len
                if dcache is not None:
                    dcache.lengths[s] = ctx_len
            # 1. drafts (not timed: sunk when the budget decides; module docstring). Dense
            # [Σℓ, V] p_d rows at T > 0 cost verification the same whatever their values.
            tokens = [[self.rng.randrange(V) for _ in range(l)] for l in lengths]
            flat = [t for ts in tokens for t in ts]
            probs = None
            if self.temperature > 0:
                probs = torch.zeros(len(flat), V)
                if flat:
                    probs[torch.arange(len(flat)), torch.tensor(flat)] = 1.0
            t0 = time.perf_counter()
            # 2. ONE ragged verification forward over B tokens
            ids: list[int] = []
            spans = []
            for s, a, ts in zip(slots, anchors.tolist(), tokens):
                spans.append(SeqSpan(s, ctx_len, 1 + len(ts)))
                ids.append(a)
                ids.extend(ts)
            out = self.model.forward(
                torch.tensor(ids), spans, self.cache, torch.arange(len(ids)), spec.tap_layers
            )
            # 3. verify (warp + accept/resample), 4. commit caches
            res = spec_round(
                out.logits, probs, torch.tensor([t for ts in tokens for t in ts], dtype=torch.long),
                lengths, [ctx_len] * r, *sampling.tensors, gens,
            )  # fmt: skip
            for s, keep in zip(slots, res.keep_target):
                self.cache.truncate(s, keep)
            if drafter is not None and out.taps is not None:
                spec.extend_context(out.taps[res.commit_rows], slots, res.commit_counts)
            dt = time.perf_counter() - t0
        finally:
            for s in slots:
                if dcache is not None:
                    dcache.reset(s)
                self.cache.free(s)
        self.calls += 1
        return dt


# --------------------------------------------------------------------- keys
def engine_version() -> str:
    """``"<PROFILE_VERSION>+<sha256 of the runtime package's sources>[:12]"``."""
    h = hashlib.sha256()
    for rel in _hot_path():
        h.update(rel.encode())
        h.update((_ROOT / rel).read_bytes())
    return f"{PROFILE_VERSION}+{h.hexdigest()[:12]}"


def drafter_id(speculator: "Speculator") -> str:
    """Architecture of the draft side (what its cost depends on), e.g.
    ``"dspark:L2:r64:vanilla:bs7:taps2,8,14,20,26"`` or ``"prompt_lookup"``."""
    d = speculator.drafter
    if d is None:
        return speculator.method
    c = d.cfg
    taps = ",".join(str(t) for t in c.target_layer_ids)
    fast = speculator.fast
    # the draft-vocabulary drafters cost less per round than the reference
    path = "" if fast is None else f":{fast.kind}:N{fast.vocab.numel()}"
    return f"{speculator.method}:L{c.num_layers}:r{c.markov_rank}:{c.markov_variant}:bs{c.block_size}:taps{taps}{path}"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sps_cache_dir() -> Path:
    """``runtime.config.cache_dir() / "sps"`` (honours ``$SPARKGATE_CACHE_DIR``)."""
    return cache_dir() / "sps"


def sps_cache_key(config: "EngineConfig", model: "LlamaModel", speculator: "Speculator", temperature: float = 1.0) -> dict:
    """Cache key of this engine's profile at ``temperature`` (see the module docstring)."""
    device = model.embed_tokens.weight.device
    return sps_mod.cache_key(
        model=MODEL_NAME,
        dtype=model.serving_dtype,
        device=f"{device.type}:{_device_name(device)}",
        num_threads=torch.get_num_threads(),
        engine_version=engine_version(),
        torch=torch.__version__,
        gamma=int(speculator.gamma),
        drafter=drafter_id(speculator),
        max_verify_tokens=config.max_batch_size * (1 + int(speculator.gamma)),
        temperature=float(temperature),
    )


# ----------------------------------------------------------------- start-up
def initial_sps_table(config: "EngineConfig", model: "LlamaModel", speculator: "Speculator",
                      temperature: float = 1.0) -> SpsTable | None:
    """The table a new :class:`~runtime.speculation.speculator.Speculator` uses for batches at
    ``temperature`` (1.0: any sampled row; 0.0: all greedy); never profiles.

    Order: ``config.sps_table_path`` (any table file, used as is; raises OSError /
    ValueError if unreadable) → the cached profile for :func:`sps_cache_key` →
    :func:`runtime.speculation.sps.fallback_table` (T = 1) or ``None`` (T = 0: the engine then uses
    the T = 1 table for greedy batches too).
    """
    if config.sps_table_path:
        table = SpsTable.load(config.sps_table_path)
        log.info("SPS table from %s", config.sps_table_path)
        return table
    key = sps_cache_key(config, model, speculator, temperature)
    table = sps_mod.load_cached(key, sps_cache_dir())
    if table is not None:
        log.info("SPS table: cached profile %s", sps_mod.cache_path(key, sps_cache_dir()))
        return table
    if temperature <= 0:
        return None  # greedy batches fall back to the sampled batches' table
    if not config.profile_on_start:
        log.warning("no SPS profile for this engine: using the illustrative fallback table (run `sparkgate profile`)")
    return sps_mod.fallback_table()


def profile_table(
    round_fn: Callable[[int, int], float],
    key: dict,
    *,
    max_requests: int,
    max_context: int,
    gamma: int,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    repeats: int = DEFAULT_REPEATS,
    warmup: int = DEFAULT_WARMUP,
    save: bool = True,
    temperature: float = 1.0,
) -> SpsTable:
    """Profile an SPS table by timing ``round_fn(B, ctx_len) -> seconds``.

    Buckets: :func:`profile_buckets` (every B to 16, then sparser up to ``max_requests·(1+γ)``);
    contexts: :func:`profile_context_lens`. The table carries ``key`` (see
    :func:`sps_cache_key`) and, if ``save``, is written to :func:`sps_cache_dir` — unless other
    processes used more than :data:`BUSY_CORES_LIMIT` cores meanwhile (:func:`other_cpu_load`):
    such a table serves this run and is not cached.

    Returns:
        The monotonised :class:`SpsTable` (its ``note`` records the cost in seconds).
    """
    buckets = profile_buckets(max_requests, gamma)
    ctxs = profile_context_lens(max_context, gamma, context_lens)
    others = other_cpu_load()
    t0 = time.perf_counter()
    # The first rounds after start-up or idle run slow (measured: 15.8 ms for B = 1 against
    # 7.0 ms once warm, through the first cell's warm-up and repeats), and B = 1 is the first
    # cell: without this its SPS is too low, which makes every verified row look cheap.
    while time.perf_counter() - t0 < GLOBAL_WARMUP_S:
        round_fn(buckets[0], ctxs[0])
        round_fn(buckets[-1], ctxs[0])
    # No throughput monotonisation (SpsTable step 3): it assumes B rows can run as B − 1 rows
    # plus an idle one, but a round is ONE forward, and MKL's GEMM steps past a row count. On
    # the Ice Lake Xeon (fp32, packed) 8 → 9 verified rows cost +40 % (bench/fp32_gemm.py);
    # step 3 capped it at 9/8 = +12.5 % (and 10–16 rows at B/9 of 9), so at c = 8 the budget
    # admitted rows that did not pay (HTTP frontier c = 8 aggregate 0.90× AR; docs/benchmarks.md).
    table = sps_mod.profile(round_fn, buckets, ctxs, repeats, warmup=warmup, key=key, note="", enforce_throughput=False)
    cost = time.perf_counter() - t0
    table.note = (
        f"profiled by runtime.speculation.sps_profiler in {cost:.1f} s: median of {repeats} timed rounds "
        f"(+{warmup} warm-up) per cell, cells interleaved in shuffled passes; B tokens over ceil(B/(1+γ)) requests, "
        f"verification only, T={temperature:g}"
    )
    log.info("SPS profile took %.1f s (%d rounds)", cost, len(buckets) * len(ctxs) * (repeats + warmup))
    busy = others()
    if save and busy > BUSY_CORES_LIMIT:
        log.warning("other processes used %.2f CPU cores during the SPS profile (limit %.2f): its table is used "
                    "for this run but not cached; the next start profiles again", busy, BUSY_CORES_LIMIT)
        table.note += f"; not cached: other processes used {busy:.2f} cores"
    elif save:
        path = sps_mod.save_cached(table, sps_cache_dir())
        log.info("SPS profile cached at %s", path)
    return table


def make_round_fn(model: "LlamaModel", speculator: "Speculator", cache: "KVCache",
                  temperature: float = 1.0) -> Callable[[int, int], float]:
    """The round function of an engine's parts: :class:`EngineRoundFn` (tests monkeypatch this factory)."""
    return EngineRoundFn(model, speculator, cache, temperature=temperature)


def ensure_profiled(
    config: "EngineConfig", model: "LlamaModel", speculator: "Speculator",
    round_fn_for: Callable[[float], Callable[[int, int], float]],
) -> SpsTable:
    """Start-up hook (``EngineConfig.profile_on_start``): keep an explicit table or ones whose
    keys match, else load the cached profiles, else profile now and cache them — one table per
    temperature of :data:`PROFILE_TEMPERATURES` (``speculator.sps_table`` for sampled batches,
    ``speculator.sps_table_greedy`` for all-greedy ones). ``round_fn_for(temperature)``: an idle
    engine's round at that temperature (see :func:`make_round_fn`). Returns the T = 1 table."""
    if config.sps_table_path:
        return speculator.sps_table
    for temperature in PROFILE_TEMPERATURES:
        key = sps_cache_key(config, model, speculator, temperature)
        current = speculator.sps_table if temperature > 0 else speculator.sps_table_greedy
        if current is not None and current.key == key:
            continue
        table = sps_mod.load_cached(key, sps_cache_dir())
        if table is None:
            table = profile_table(round_fn_for(temperature), key, max_requests=config.max_batch_size,
                                  max_context=config.max_context, gamma=speculator.gamma, temperature=temperature)
        if temperature > 0:
            speculator.sps_table = table
        else:
            speculator.sps_table_greedy = table
    return speculator.sps_table
