"""The RL loop's model, reward, loss and weight checksum (``testing.rl_step`` runs them)."""

from __future__ import annotations

from typing import Any

__all__ = ["TINY_QWEN3", "build_model", "checksum", "grpo_loss", "reward"]

TINY_QWEN3 = (("vocab_size", 256), ("hidden_size", 64), ("intermediate_size", 128), ("num_hidden_layers", 2),
              ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 16),
              ("max_position_embeddings", 64))


def build_model(config: Any, device):
    """The same Qwen3 in every process (same seed), random weights, in ``config.dtype``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**dict(config.model), tie_word_embeddings=False, attention_dropout=0.0, use_cache=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(config.seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(getattr(torch, config.dtype))


def reward(completions, vocab_size: int):
    """Synthetic: the share of completion tokens in the lower half of the vocabulary."""
    return (completions < vocab_size // 2).float().mean(dim=1)


def grpo_loss(model, batches: list[dict[str, Any]], prompt_len: int, group: int):
    """GRPO-style: advantages are rewards normalised within each prompt's group; the loss
    is minus the advantage-weighted mean log-probability of the completion tokens."""
    import torch

    tokens = torch.cat([b["tokens"] for b in batches]).to(next(model.parameters()).device)
    rewards = torch.cat([b["rewards"] for b in batches]).to(tokens.device).view(-1, group)
    adv = ((rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-4)).view(-1)
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits[:, prompt_len - 1:].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)
    return -(adv[:, None] * logp).mean(), float(rewards.mean())


def checksum(tensors) -> list[int]:
    """Per tensor (name order): sum and sum of squares of its bits as int16: additive over
    any split of the elements, so FSDP shards' checksums add up to the whole tensor's."""
    import torch

    out = []
    for _, t in sorted(tensors.items()):
        bits = t.detach().contiguous().view(-1).view(torch.int16)
        s1 = int(bits.sum(dtype=torch.int64))
        s2 = sum(int((c.to(torch.int32) ** 2).sum(dtype=torch.int64)) for c in bits.split(1 << 26))
        out += [s1, s2]
    return out
