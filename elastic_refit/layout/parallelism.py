"""Parallelism specs of the presets: Megatron training and vLLM inference degrees (``tp=4,
pp=8,ep=16,dp=4``), their checks, and the vocabulary padding each framework applies.

Shared by the explicit presets (``layout.presets``) and the rules they are built from
(``layout.symbolic_presets``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_refit._validate import is_integer

__all__ = ["MEGATRON_VOCAB_DIVISOR", "VLLM_VOCAB_PADDING", "InferenceParallelism", "TrainingParallelism",
           "parse_parallelism", "stage_layers"]

MEGATRON_VOCAB_DIVISOR = 128  # Megatron's default make_vocab_size_divisible_by
VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


# ---- parallelism specs ---------------------------------------------------------------------
def _check_sizes(kind: str, why: str = "", **sizes: int) -> None:
    """Every size a positive integer, and ``ep`` dividing ``tp * dp`` (``why`` ends that error)."""
    for key, value in sizes.items():
        if not is_integer(value, numpy=True) or value < 1:
            raise ValueError(f"{kind}: {key} must be a positive integer, got {value!r}")
    tp, dp, ep = sizes["tp"], sizes["dp"], sizes["ep"]
    if (tp * dp) % ep:
        raise ValueError(f"{kind}: ep={ep} must divide tp*dp={tp * dp}{why}")


@dataclass(frozen=True, slots=True)
class TrainingParallelism:
    """Megatron-style training sizes: tensor, pipeline, data and expert parallel (etp = 1)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1

    def __post_init__(self) -> None:
        _check_sizes(
            "training parallelism",
            " (experts re-factor a stage's tp x dp ranks as ep x edp)",
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            ep=self.ep,
        )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp},ep={self.ep}"


@dataclass(frozen=True, slots=True)
class InferenceParallelism:
    """vLLM-style inference sizes: tensor and data parallel, optional expert parallel."""

    tp: int
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        _check_sizes("inference parallelism", tp=self.tp, dp=self.dp, ep=self.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp},ep={self.ep}"


_KEYS = ("tp", "pp", "dp", "ep", "etp")


def parse_parallelism(
    text: str, side: str | None = None
) -> TrainingParallelism | InferenceParallelism:
    """Parse ``"tp=4,pp=8,ep=16,dp=4"``; missing sizes are 1.

    ``side``: ``"training"`` gives a ``TrainingParallelism``, ``"inference"`` an
    ``InferenceParallelism`` (which has no ``pp``); ``None`` picks training when ``pp`` is
    given. ``etp`` is accepted only as 1 (expert tensor parallelism is not modelled).
    """
    if side not in (None, "training", "inference"):
        raise ValueError(f"side must be 'training', 'inference' or None, got {side!r}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"parallelism must be a string like 'tp=4,pp=8,ep=16,dp=4', got {text!r}")
    sizes: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or not key:
            raise ValueError(f"bad parallelism item {item.strip()!r} in {text!r}: use key=value")
        if key not in _KEYS:
            raise ValueError(f"unknown parallelism key {key!r} in {text!r}; known: {', '.join(_KEYS)}")
        if key in sizes:
            raise ValueError(f"parallelism key {key!r} given twice in {text!r}")
        try:
            number = int(value.strip())
        except ValueError:
            raise ValueError(f"parallelism {key}={value.strip()!r} in {text!r} is not an integer") from None
        if number < 1:
            raise ValueError(f"parallelism {key}={number} in {text!r} must be >= 1")
        sizes[key] = number
    if sizes.pop("etp", 1) != 1:
        raise ValueError(f"{text!r}: only etp=1 (whole experts per EP rank) is supported")
    if side == "training" or (side is None and "pp" in sizes):
        return TrainingParallelism(sizes.get("tp", 1), sizes.get("pp", 1), sizes.get("dp", 1), sizes.get("ep", 1))
    if sizes.get("pp", 1) != 1:
        raise ValueError(f"{text!r}: inference layouts have no pipeline stages (pp={sizes['pp']})")
    return InferenceParallelism(sizes.get("tp", 1), sizes.get("dp", 1), sizes.get("ep", 1))


def _as_training(par: TrainingParallelism | InferenceParallelism | str) -> TrainingParallelism:
    if isinstance(par, str):
        par = parse_parallelism(par, side="training")
    if isinstance(par, InferenceParallelism):
        return TrainingParallelism(par.tp, 1, par.dp, par.ep)
    if not isinstance(par, TrainingParallelism):
        raise ValueError(f"expected a TrainingParallelism or a 'tp=..,pp=..' string, got {par!r}")
    return par


def _as_inference(par: TrainingParallelism | InferenceParallelism | str) -> InferenceParallelism:
    if isinstance(par, str):
        par = parse_parallelism(par, side="inference")
    if isinstance(par, TrainingParallelism):
        if par.pp != 1:
            raise ValueError(f"vLLM layouts have no pipeline stages, got {par}")
        return InferenceParallelism(par.tp, par.dp, par.ep)
    if not isinstance(par, InferenceParallelism):
        raise ValueError(f"expected an InferenceParallelism or a 'tp=..,dp=..' string, got {par!r}")
    return par


def _check_first_rank(first_rank: int) -> int:
    if not is_integer(first_rank, numpy=True) or first_rank < 0:
        raise ValueError(f"first_rank must be an integer >= 0, got {first_rank!r}")
    return int(first_rank)


# ---- shared by the rules ---------------------------------------------------------------------
def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Global layer indices of each pipeline stage: the first ``num_layers % pp`` stages
    take one layer more; stages may be empty when ``pp > num_layers``."""
    base, extra = divmod(num_layers, pp)
    counts = [base + (s < extra) for s in range(pp)]
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [range(int(starts[s]), int(starts[s + 1])) for s in range(pp)]


# ---- the constructors (from the rules) ------------------------------------------------------
