"""FlashAttention-2's variable-length contract in pure torch, so verl's remove-padding and Ulysses sequence-parallel
code runs on CPU as written.

verl's Ulysses patch (``verl.models.transformers.monkey_patch._ulysses_flash_attention_forward``) wraps the function
transformers' ``flash_attention_2`` path calls, ``_flash_attention_forward(q, k, v, attention_mask, query_length,
..., position_ids=...)``: it gathers the sequence and scatters the heads over the SP group (all-to-all), calls the
kernel, and scatters back. Under ``sdpa`` that wrapper never runs, so each rank would attend to its own slice of the
sequence only: silently wrong. With the CPU platform active, verl_traj registers the attention implementation
:data:`CPU_VARLEN` (transformers' own ``flash_attention_forward`` and mask function under another name) and puts
:func:`varlen_attention` where the CUDA kernel would be, in both places verl and transformers look it up
(:mod:`verl_traj.integration.patches.process`). Start-up selects it for a model whose Ulysses size is > 1
(:mod:`verl_traj.integration.startup.cpu_settings`); ``actor_rollout_ref.model.override_config.attn_implementation=cpu_varlen`` (and the
critic's) selects it for any run.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from verl_traj.integration.config.attention_names import CPU_VARLEN  # the attn_implementation name

__all__ = ["CPU_VARLEN", "allowed_keys", "flash_mask", "flash_path", "varlen_attention"]


def _sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` index of the packed sequence each position belongs to: a new one starts wherever the position does
    not continue the previous one (transformers' ``find_packed_sequence_indices`` rule)."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).long()
    return starts.cumsum(-1)


def allowed_keys(batch: int, q_len: int, kv_len: int, *, is_causal: bool, attention_mask: Optional[torch.Tensor],
                 position_ids: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[b, q_len, kv_len]`` bool: which keys each query attends to. Causal (queries aligned to the last keys),
    within its own packed sequence (``position_ids``, when no padding mask is given: verl's remove-padding layout),
    never to padding keys (a ``[b, kv_len]`` 0/1 ``attention_mask``). Every query keeps at least its own key, so a
    padding query gives a finite (ignored) output instead of NaN."""
    q_idx = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    k_idx = torch.arange(kv_len, device=device)[None, :]
    allowed = (k_idx <= q_idx) if is_causal else torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    allowed = allowed.expand(batch, q_len, kv_len)
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, -kv_len:]
    elif position_ids is not None and q_len == kv_len:
        seq = _sequence_ids(position_ids.to(device).expand(batch, -1))
        allowed = allowed & (seq[:, :, None] == seq[:, None, :])
    return allowed | (q_idx == k_idx)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], query_length: int, is_causal: bool = True,
                     dropout: float = 0.0, position_ids: Optional[torch.Tensor] = None,
                     softmax_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None, **_: Any) -> torch.Tensor:
    """transformers' ``_flash_attention_forward`` in torch: ``query`` ``[b, s, h, d]``, ``key`` / ``value``
    ``[b, s_k, h_k, d]`` (``h`` a multiple of ``h_k``: grouped-query attention) -> ``[b, s, h, d]``. Packed
    sequences attend only within themselves, as ``flash_attn_varlen_func`` with ``cu_seqlens`` from ``position_ids``
    does (one scaled-dot-product attention with a block-diagonal causal mask)."""
    if sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            f"the CPU attention '{CPU_VARLEN}' has no sliding window or soft-capping (sliding_window={sliding_window}, "
            f"softcap={softcap}); use attn_implementation=sdpa for this model on CPU.")
    b, s, h, _ = query.shape
    if key.shape[2] != h:
        key = key.repeat_interleave(h // key.shape[2], dim=2)
        value = value.repeat_interleave(h // value.shape[2], dim=2)
    allowed = allowed_keys(b, s, key.shape[1], is_causal=is_causal, attention_mask=attention_mask,
                           position_ids=position_ids, device=query.device)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         attn_mask=allowed[:, None], dropout_p=dropout, scale=softmax_scale)
    return out.transpose(1, 2)


def flash_path() -> Any:
    """transformers' ``flash_attention_forward`` (the attention function of its flash-attention implementations),
    registered as :data:`CPU_VARLEN`: it calls ``_flash_attention_forward`` by its module global, which verl's
    Ulysses patch replaces by its all-to-all wrapper."""
    # local: every process's `import verl` loads this module (plugin); only CPU/torch_varlen ones need transformers'
    from transformers.integrations.flash_attention import flash_attention_forward

    return flash_attention_forward


def flash_mask() -> Any:
    """transformers' flash-attention mask function (``None`` when fully causal, else the 2-D padding mask)."""
    # local: as in flash_path: every `import verl` loads this module; only CPU/torch_varlen processes need the mask
    from transformers.masking_utils import flash_attention_mask

    return flash_attention_mask
