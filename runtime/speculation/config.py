"""DSpark drafter hyper-parameters (paper §3.1–3.2), one plain dataclass.

The drafter's layer geometry (hidden size, heads, MLP width, RoPE) is always the
target's (:class:`runtime.models.llama.LlamaConfig`); this config only holds what
DSpark adds on top. It is stored verbatim in a checkpoint's ``config.json``
(:mod:`runtime.speculation.checkpoint`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

MARKOV_VARIANTS = ("vanilla", "gated")


@dataclass
class DrafterConfig:
    """Architecture of a DSpark drafter for a given target.

    Attributes:
        target_layer_ids: target decoder layers whose outputs are the context
            features (paper §3.1; DeepSpec uses 5 spread from early to late). Strictly
            increasing, in ``[0, num_target_layers - 2]`` — never the final layer.
            Default for the 30-layer SmolLM2: ``[2, 8, 14, 20, 26]``.
        block_size: γ, slots per draft block (anchor + γ−1 mask tokens) = draft
            tokens proposed per forward. Default 7 (paper Table 1).
        num_layers: draft decoder layers (target's layer design). Default 2: the paper
            shows 2 layers with the Markov head already beat a 5-layer DFlash, and on
            the CPU the block forward stays ≪ one target step.
        markov_rank: r of the Markov head (W1 ∈ R^{V×r}, W2 ∈ R^{r×V}); 0 disables the
            head (parallel-only / DFlash-style ablation). Default 64 (paper: 256 for a
            ~150k vocabulary; SmolLM2 has 49152).
        markov_variant: ``"vanilla"`` (bias = W1[x_{k−1}] W2) or ``"gated"``
            (bias = (σ(G [h_k; W1[x_{k−1}]]) ⊙ W1[x_{k−1}]) W2).
        sts_temperatures: per-position temperatures T_1..T_γ of Sequential
            Temperature Scaling (paper §3.2.1); the confidence is σ(logit_k / T_k).
            ``None`` → all 1 (uncalibrated).
        init_seed: seed of the random initialisation (recorded for provenance).
    """

    target_layer_ids: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 26])
    block_size: int = 7
    num_layers: int = 2
    markov_rank: int = 64
    markov_variant: str = "vanilla"
    sts_temperatures: list[float] | None = None
    init_seed: int = 0

    def validate(self, num_target_layers: int) -> None:
        """Check internal consistency against a target with ``num_target_layers``.

        Raises:
            ValueError: on any invalid field (message names the field).
        """
        ids = list(self.target_layer_ids)
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        if ids[0] < 0 or ids[-1] > num_target_layers - 2:
            raise ValueError(
                f"target_layer_ids must lie in [0, {num_target_layers - 2}] (never the final layer), got {ids}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_variant not in MARKOV_VARIANTS:
            raise ValueError(f"markov_variant must be one of {MARKOV_VARIANTS}, got {self.markov_variant!r}")
        if self.sts_temperatures is not None:
            if len(self.sts_temperatures) != self.block_size:
                raise ValueError(
                    f"sts_temperatures has {len(self.sts_temperatures)} entries, block_size is {self.block_size}"
                )
            if any(not t > 0 for t in self.sts_temperatures):
                raise ValueError(f"sts_temperatures must be > 0, got {self.sts_temperatures}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: on unknown keys (a checkpoint from a different format).
        """
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DrafterConfig keys: {sorted(unknown)}")
        return cls(**d)
