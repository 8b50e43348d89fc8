"""Job specs (the JSON that ``elastic_refit.layout.parse_spec`` reads) of the small models
that the chaos trials, the soak, the demo and the benchmarks run.

They live in the testing toolkit, not in ``elastic_refit.chaos``: the chaos runner builds on
testing, and so do the soak and the benchmarks, which run no fault.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["NUM_TRAINERS", "demo_spec", "tiny_spec_json"]

# Trainer ranks 0 and 1 of every spec here: data-parallel replicas holding whole tensors.
NUM_TRAINERS = 2


def tiny_spec_json(num_inference: int) -> str:
    """The chaos trials' model: tiny tensors; trainers 0, 1 are replicas (whole tensors);
    inference ranks are replicas too (2, or any odd number), or replicas of TP=2 (4, 6, ...)."""
    if num_inference < 2:
        raise ValueError(f"num_inference must be >= 2, got {num_inference}")
    first = NUM_TRAINERS
    if num_inference == 2 or num_inference % 2:
        dst_mesh: Any = list(range(first, first + num_inference))
        placements = {"w": ["R"], "experts": ["R"], "norm": ["R"]}
    else:
        dst_mesh = [[first + 2 * r, first + 2 * r + 1] for r in range(num_inference // 2)]
        placements = {"w": ["R", "S(0)"], "experts": ["R", "S(1)"], "norm": ["R", "R"]}
    src = {"mesh": list(range(NUM_TRAINERS)), "placements": ["R"]}
    return json.dumps({
        "domains": [0] * NUM_TRAINERS + [1] * num_inference,
        "tensors": [
            {"name": "w", "shape": [96, 64], "dtype": "bfloat16", "source": src,
             "destination": {"mesh": dst_mesh, "placements": placements["w"]}},
            {"name": "experts", "shape": [4, 32, 16], "dtype": "float32", "source": src,
             "destination": {"mesh": dst_mesh, "placements": placements["experts"]}},
            {"name": "norm", "shape": [64], "dtype": "float32", "source": src,
             "destination": {"mesh": dst_mesh, "placements": placements["norm"]}},
        ],
    })


def demo_spec(num_inference: int = 4, inference_tp: int = 2, hidden: int = 192, num_layers: int = 2,
              vocab: int = 960) -> dict[str, Any]:
    """Spec of the demo model: trainers 0 and 1 are data-parallel replicas (whole tensors);
    inference ranks 2.. are ``num_inference / inference_tp`` replicas of a tensor-parallel
    layout (column-parallel S(0), row-parallel S(1), norms replicated), all in one domain.
    Replicas on the inference side are what let a restarted rank catch up from its peers
    after the trainers dropped the version."""
    if inference_tp < 1 or num_inference < 2 * inference_tp or num_inference % inference_tp:
        raise ValueError(f"num_inference must be a multiple >= 2x of inference_tp={inference_tp} (a killed rank "
                         f"needs a replica), got {num_inference}")
    src = {"mesh": list(range(NUM_TRAINERS)), "placements": ["R"]}
    first = NUM_TRAINERS
    dst_mesh = [list(range(first + r * inference_tp, first + (r + 1) * inference_tp))
                for r in range(num_inference // inference_tp)]

    def tensor(name: str, shape: list[int], placement: str) -> dict[str, Any]:
        return {"name": name, "shape": shape, "dtype": "bfloat16", "source": src,
                "destination": {"mesh": dst_mesh, "placements": ["R", placement]}}

    tensors = [tensor("embed_tokens.weight", [vocab, hidden], "S(0)")]
    for layer in range(num_layers):
        p = f"layers.{layer}."
        tensors += [
            tensor(p + "input_layernorm.weight", [hidden], "R"),
            tensor(p + "self_attn.qkv_proj.weight", [3 * hidden, hidden], "S(0)"),
            tensor(p + "self_attn.o_proj.weight", [hidden, hidden], "S(1)"),
            tensor(p + "post_attention_layernorm.weight", [hidden], "R"),
            tensor(p + "mlp.up_proj.weight", [4 * hidden, hidden], "S(0)"),
            tensor(p + "mlp.down_proj.weight", [hidden, 4 * hidden], "S(1)"),
        ]
    tensors += [tensor("norm.weight", [hidden], "R"), tensor("lm_head.weight", [vocab, hidden], "S(0)")]
    return {"domains": [0] * NUM_TRAINERS + [1] * num_inference, "tensors": tensors}
