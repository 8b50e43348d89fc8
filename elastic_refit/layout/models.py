"""Model architectures as parameter inventories in HF naming (experts stacked as ``[E, ...]``).

``ModelConfig`` holds only what changes the set, shapes or dtypes of the weights of the
supported architectures: Llama-style dense GQA models, Qwen3 (qk-norm) dense and MoE,
and DeepSeek-V3-style MLA + MoE models (DeepSeek-V3, Kimi-K2). ``config_from_hf`` reads
a local HF ``config.json``; the published configs of the preset models ship in
``configs/`` and are registered in ``MODELS``.

Multi-token-prediction (MTP) layers are not part of the inventory: RL refits move the
policy, and inference engines load MTP weights separately, if at all.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from elastic_refit._validate import is_integer
from elastic_refit.layout.box import canonical_dtype
from elastic_refit.layout.core import LogicalTensor

__all__ = [
    "MODELS",
    "ModelConfig",
    "config_from_hf",
    "get_model",
    "logical_tensors",
    "parameter_count",
]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The weight-shaping hyper-parameters of one decoder-only model.

    MoE: ``num_experts > 0``; layers ``< first_k_dense`` keep a dense MLP of
    ``intermediate_size``, the others hold ``num_experts`` routed experts of
    ``moe_intermediate_size`` plus ``num_shared_experts`` shared experts fused into one MLP
    of ``num_shared_experts * moe_intermediate_size``. MLA: ``kv_lora_rank > 0``
    (``q_lora_rank`` may be ``None``: a plain ``q_proj``); ``head_dim`` then is unused.
    """

    name: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0
    router_bias: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"model name must be a non-empty string, got {self.name!r}")
        positive = ("hidden_size", "num_layers", "vocab_size", "num_heads", "num_kv_heads", "head_dim")
        non_negative = ("intermediate_size", "num_experts", "moe_intermediate_size",
                        "num_shared_experts", "first_k_dense", "kv_lora_rank", "qk_nope_head_dim",
                        "qk_rope_head_dim", "v_head_dim")
        for field_name in positive + non_negative:
            value = getattr(self, field_name)
            if not is_integer(value):
                raise ValueError(f"model {self.name!r}: {field_name} must be an integer, got {value!r}")
            if value < (1 if field_name in positive else 0):
                bound = ">= 1" if field_name in positive else ">= 0"
                raise ValueError(f"model {self.name!r}: {field_name} must be {bound}, got {value}")
        if self.q_lora_rank is not None and (not is_integer(self.q_lora_rank) or self.q_lora_rank < 1):
            raise ValueError(f"model {self.name!r}: q_lora_rank must be None or >= 1, got {self.q_lora_rank!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts:
            if self.moe_intermediate_size < 1:
                raise ValueError(
                    f"model {self.name!r}: {self.num_experts} experts need moe_intermediate_size >= 1, "
                    f"got {self.moe_intermediate_size}"
                )
        elif self.num_shared_experts or self.router_bias:
            raise ValueError(
                f"model {self.name!r}: shared experts ({self.num_shared_experts}) or a router bias "
                f"({self.router_bias}) need num_experts > 0"
            )
        if self.first_k_dense and self.intermediate_size < 1:
            raise ValueError(
                f"model {self.name!r}: first_k_dense={self.first_k_dense} dense layers need "
                f"intermediate_size >= 1"
            )
        if not self.num_experts and self.intermediate_size < 1:
            raise ValueError(f"model {self.name!r}: a dense model needs intermediate_size >= 1")
        if self.kv_lora_rank:
            if min(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim) < 1:
                raise ValueError(
                    f"model {self.name!r}: MLA needs qk_nope_head_dim + qk_rope_head_dim >= 1 and "
                    f"v_head_dim >= 1, got {self.qk_nope_head_dim}, {self.qk_rope_head_dim}, "
                    f"{self.v_head_dim}"
                )
            if self.qk_norm:
                raise ValueError(f"model {self.name!r}: qk_norm is not defined for MLA attention")
        elif self.q_lora_rank is not None:
            raise ValueError(
                f"model {self.name!r}: q_lora_rank={self.q_lora_rank} needs MLA (kv_lora_rank > 0)"
            )

    # ---- derived ------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (MLA: nope + rope; else ``head_dim``)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense

    def with_layers(self, num_layers: int | None) -> ModelConfig:
        """The same model cut to its first ``num_layers`` layers (``None``: unchanged)."""
        if num_layers is None:
            return self
        if not is_integer(num_layers) or not 1 <= num_layers <= self.num_layers:
            raise ValueError(
                f"model {self.name!r}: num_layers must be in 1..{self.num_layers}, got {num_layers!r}"
            )
        return dataclasses.replace(self, num_layers=num_layers)


# ---- HF config.json -----------------------------------------------------------------------
_MLA_TYPES = ("deepseek_v3", "kimi_k2")
_SUPPORTED_TYPES = ("llama", "qwen3", "qwen3_moe", *_MLA_TYPES)


def config_from_hf(path_or_dict: str | Path | Mapping[str, object], name: str | None = None) -> ModelConfig:
    """A ``ModelConfig`` from a local HF ``config.json`` (a file, its folder, or the parsed dict).

    Supported ``model_type``: llama, qwen3, qwen3_moe, deepseek_v3, kimi_k2. No network.
    """
    raw, source, name = _read_hf_config(path_or_dict, name)
    model_type = raw.get("model_type")
    if model_type not in _SUPPORTED_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; known: {', '.join(_SUPPORTED_TYPES)}"
        )
    name = name or str(raw.get("_name_or_path") or model_type)
    common = _hf_common_fields(raw, source, name)
    if model_type in ("llama", "qwen3"):
        return ModelConfig(**common, qk_norm=model_type == "qwen3")
    if model_type == "qwen3_moe":
        return _qwen3_moe_config(raw, source, common)
    return _deepseek_v3_config(raw, source, common)  # Kimi-K2 reuses the DeepSeek-V3 architecture


def _read_hf_config(path_or_dict: str | Path | Mapping[str, object],
                    name: str | None) -> tuple[dict, str, str | None]:
    """(the raw config, where it came from for messages, the name: given, else the file's folder)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "config dict", name
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no HF config at {str(path)!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(raw).__name__}")
    if name is None:
        name = path.parent.name or None
    return raw, str(path), name


def _hf_need(raw: Mapping[str, object], source: str, key: str) -> int:
    """``raw[key]``, or a ``ValueError`` naming the key the model type needs."""
    if key not in raw:
        raise ValueError(f"{source}: missing {key!r} for model_type {raw.get('model_type')!r}")
    return raw[key]  # type: ignore[return-value]


def _hf_common_fields(raw: Mapping[str, object], source: str, name: str) -> dict[str, object]:
    """The ``ModelConfig`` fields every supported model type sets, from an HF config."""
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(f"{source}: attention_bias / mlp_bias are not supported")
    hidden = _hf_need(raw, source, "hidden_size")
    heads = _hf_need(raw, source, "num_attention_heads")
    return dict(
        name=name,
        hidden_size=hidden,
        num_layers=_hf_need(raw, source, "num_hidden_layers"),
        vocab_size=_hf_need(raw, source, "vocab_size"),
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate_size=_hf_need(raw, source, "intermediate_size"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype=raw.get("torch_dtype") or raw.get("dtype") or "bfloat16",
    )


def _qwen3_moe_config(raw: Mapping[str, object], source: str, common: dict[str, object]) -> ModelConfig:
    """A Qwen3-MoE config: every layer MoE (mixed dense/MoE layers are refused)."""
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"{source}: mixed dense/MoE layers (mlp_only_layers={raw.get('mlp_only_layers')}, "
            f"decoder_sparse_step={raw.get('decoder_sparse_step')}) are not supported"
        )
    return ModelConfig(
        **common, num_experts=_hf_need(raw, source, "num_experts"),
        moe_intermediate_size=_hf_need(raw, source, "moe_intermediate_size"), qk_norm=True,
    )


def _deepseek_v3_config(raw: Mapping[str, object], source: str, common: dict[str, object]) -> ModelConfig:
    """A DeepSeek-V3-architecture config (MLA + MoE after ``first_k_dense`` dense layers)."""
    if raw.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{source}: moe_layer_freq={raw.get('moe_layer_freq')} is not supported")
    num_experts = raw.get("n_routed_experts") or 0
    return ModelConfig(
        **common,
        num_experts=num_experts,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        num_shared_experts=raw.get("n_shared_experts") or 0,
        first_k_dense=raw.get("first_k_dense_replace", 0) if num_experts else 0,
        # HF's DeepseekV3 router always carries e_score_correction_bias (noaux_tc routing).
        router_bias=bool(num_experts) and raw.get("topk_method", "noaux_tc") == "noaux_tc",
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=_hf_need(raw, source, "kv_lora_rank"),
        qk_nope_head_dim=_hf_need(raw, source, "qk_nope_head_dim"),
        qk_rope_head_dim=_hf_need(raw, source, "qk_rope_head_dim"),
        v_head_dim=_hf_need(raw, source, "v_head_dim"),
    )


# ---- registry ------------------------------------------------------------------------------
_PRESET_FILES = ("qwen3-235b-a22b", "qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "llama-3.1-8b",
                 "llama-3.1-405b")


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().split("/")[-1])


_ALIASES = {
    "qwen3235b": "qwen3-235b-a22b",
    "qwen330b": "qwen3-30b-a3b",
    "deepseekv3": "deepseek-v3",
    "dsv3": "deepseek-v3",
    "kimik2": "kimi-k2",
    "kimi": "kimi-k2",
    "llama38b": "llama-3.1-8b",
    "llama3405b": "llama-3.1-405b",
    "kimik2instruct": "kimi-k2",
    "kimik2base": "kimi-k2",
    "llama318b": "llama-3.1-8b",
    "llama31405b": "llama-3.1-405b",
    "metallama318b": "llama-3.1-8b",
    "metallama31405b": "llama-3.1-405b",
    "llama318binstruct": "llama-3.1-8b",
    "llama31405binstruct": "llama-3.1-405b",
    "deepseekv3base": "deepseek-v3",
    "qwen3235ba22binstruct2507": "qwen3-235b-a22b",
    "qwen330ba3binstruct2507": "qwen3-30b-a3b",
}


class _ModelRegistry(Mapping[str, ModelConfig]):
    """Preset models by short name; lookups forgive case, punctuation and common aliases."""

    def __init__(self) -> None:
        self._configs: dict[str, ModelConfig] = {}
        folder = resources.files("elastic_refit.layout") / "configs"
        for short in _PRESET_FILES:
            raw = json.loads((folder / f"{short}.json").read_text())
            self._configs[short] = config_from_hf(raw, name=short)
        self._lookup = {_normalise(k): k for k in self._configs} | _ALIASES

    def resolve(self, name: str) -> str:
        """The canonical short name for ``name`` (``ValueError`` listing the known names)."""
        key = self._lookup.get(_normalise(str(name)))
        if key is None:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(self._configs)}")
        return key

    def __getitem__(self, name: str) -> ModelConfig:
        try:
            return self._configs[self.resolve(name)]
        except ValueError as e:
            raise KeyError(str(e)) from None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and _normalise(name) in self._lookup

    def __iter__(self) -> Iterator[str]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)


MODELS = _ModelRegistry()


def get_model(name_or_config: str | Path | ModelConfig) -> ModelConfig:
    """A preset by (forgiving) name, a ``ModelConfig`` as is, or a local HF config path."""
    if isinstance(name_or_config, ModelConfig):
        return name_or_config
    text = str(name_or_config)
    if text in MODELS:
        return MODELS[text]
    path = Path(text)
    if path.exists():
        return config_from_hf(path)
    raise ValueError(f"unknown model {text!r}; known: {', '.join(MODELS)} (or a path to a config.json)")


# ---- inventory -----------------------------------------------------------------------------
def _layer_tensors(c: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    p = f"model.layers.{i}."
    h, dt = c.hidden_size, c.dtype
    out: list[tuple[str, tuple[int, ...], str]] = [(p + "input_layernorm.weight", (h,), dt)]
    a = p + "self_attn."
    if c.is_mla:
        if c.q_lora_rank is None:
            out.append((a + "q_proj.weight", (c.num_heads * c.qk_head_dim, h), dt))
        else:
            out += [
                (a + "q_a_proj.weight", (c.q_lora_rank, h), dt),
                (a + "q_a_layernorm.weight", (c.q_lora_rank,), dt),
                (a + "q_b_proj.weight", (c.num_heads * c.qk_head_dim, c.q_lora_rank), dt),
            ]
        out += [
            (a + "kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h), dt),
            (a + "kv_a_layernorm.weight", (c.kv_lora_rank,), dt),
            (a + "kv_b_proj.weight", (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), dt),
            (a + "o_proj.weight", (h, c.num_heads * c.v_head_dim), dt),
        ]
    else:
        out += [
            (a + "q_proj.weight", (c.num_heads * c.head_dim, h), dt),
            (a + "k_proj.weight", (c.num_kv_heads * c.head_dim, h), dt),
            (a + "v_proj.weight", (c.num_kv_heads * c.head_dim, h), dt),
            (a + "o_proj.weight", (h, c.num_heads * c.head_dim), dt),
        ]
        if c.qk_norm:
            out += [(a + "q_norm.weight", (c.head_dim,), dt), (a + "k_norm.weight", (c.head_dim,), dt)]
    out.append((p + "post_attention_layernorm.weight", (h,), dt))
    m = p + "mlp."
    if c.is_moe_layer(i):
        e, im = c.num_experts, c.moe_intermediate_size
        out.append((m + "gate.weight", (e, h), dt))
        if c.router_bias:
            # fp32 in the HF checkpoint, in vLLM and in Megatron (router expert_bias).
            out.append((m + "gate.e_score_correction_bias", (e,), "float32"))
        out += [
            (m + "experts.gate_proj.weight", (e, im, h), dt),
            (m + "experts.up_proj.weight", (e, im, h), dt),
            (m + "experts.down_proj.weight", (e, h, im), dt),
        ]
        if c.num_shared_experts:
            s = c.shared_intermediate_size
            out += [
                (m + "shared_experts.gate_proj.weight", (s, h), dt),
                (m + "shared_experts.up_proj.weight", (s, h), dt),
                (m + "shared_experts.down_proj.weight", (h, s), dt),
            ]
    else:
        n = c.intermediate_size
        out += [
            (m + "gate_proj.weight", (n, h), dt),
            (m + "up_proj.weight", (n, h), dt),
            (m + "down_proj.weight", (h, n), dt),
        ]
    return out


def logical_tensors(config: ModelConfig, num_layers: int | None = None) -> tuple[LogicalTensor, ...]:
    """Every weight of ``config`` (its first ``num_layers`` layers) in HF naming.

    Experts of one layer are stacked: ``model.layers.{i}.mlp.experts.gate_proj.weight`` is
    ``[E, moe_intermediate, hidden]``, ``down_proj`` is ``[E, hidden, moe_intermediate]``.
    """
    c = config.with_layers(num_layers)
    h, dt = c.hidden_size, c.dtype
    rows = [("model.embed_tokens.weight", (c.vocab_size, h), dt)]
    for i in range(c.num_layers):
        rows += _layer_tensors(c, i)
    rows.append(("model.norm.weight", (h,), dt))
    if not c.tie_word_embeddings:
        rows.append(("lm_head.weight", (c.vocab_size, h), dt))
    return tuple(LogicalTensor(name, shape, dtype) for name, shape, dtype in rows)


def parameter_count(config: ModelConfig, num_layers: int | None = None) -> int:
    """Number of parameters (elements) of the model, without MTP layers."""
    return sum(t.numel for t in logical_tensors(config, num_layers))
