"""The CPU platform's variable-length attention (``cpu_varlen``): flash-attention's contract in torch, so verl's
remove-padding and Ulysses code paths compute on CPU what they compute on GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_traj.cpu.attention import CPU_VARLEN, allowed_keys, varlen_attention


def _separate(q, k, v, lengths):
    """Each packed sequence on its own: causal sdpa, grouped-query heads repeated."""
    outs, start = [], 0
    rep = q.shape[2] // k.shape[2]
    for n in lengths:
        sl = slice(start, start + n)
        qs, ks, vs = (t[:, sl].transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1)


def test_packed_sequences_attend_only_within_themselves():
    """A 7 + 2 + 5 pack (verl's remove-padding layout: position ids restart per sequence) equals three separate
    causal attentions, with grouped-query heads (4 query heads, 2 key/value heads)."""
    g = torch.Generator().manual_seed(0)
    lengths = [7, 2, 5]
    q = torch.randn(1, sum(lengths), 4, 8, generator=g)
    k, v = (torch.randn(1, sum(lengths), 2, 8, generator=g) for _ in range(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    got = varlen_attention(q, k, v, None, q.shape[1], is_causal=True, position_ids=position_ids)
    torch.testing.assert_close(got, _separate(q, k, v, lengths), rtol=1e-6, atol=1e-6)


def test_padding_keys_are_masked_and_padding_queries_stay_finite():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 2, 4, generator=g) for _ in range(3))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding in row 0
    got = varlen_attention(q, k, v, mask, 5, is_causal=True)
    assert torch.isfinite(got).all()
    ref = _separate(q[:1, 2:], k[:1, 2:], v[:1, 2:], [3])
    torch.testing.assert_close(got[:1, 2:], ref, rtol=1e-6, atol=1e-6)
    allowed = allowed_keys(1, 3, 3, is_causal=True, attention_mask=None, position_ids=None, device=torch.device("cpu"))
    assert allowed.tolist() == [[[True, False, False], [True, True, False], [True, True, True]]]


def test_a_model_with_cpu_varlen_equals_sdpa_per_sequence():
    """A tiny Qwen2 on the packed layout with attn_implementation='cpu_varlen' (registered by the CPU platform)
    gives each sequence the logits sdpa gives it alone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_traj.cpu.plugin import register

    if not register():
        pytest.skip("the CPU platform is not active in this process (an accelerator is present)")
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    sdpa = Qwen2ForCausalLM(config).eval()
    config._attn_implementation = CPU_VARLEN
    varlen = Qwen2ForCausalLM(config).eval()
    varlen.load_state_dict(sdpa.state_dict())
    seqs = [torch.randint(0, 64, (n,)) for n in (6, 3, 4)]
    with torch.no_grad():
        packed = varlen(input_ids=torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None],
                        use_cache=False).logits[0]
        alone = torch.cat([sdpa(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_what_the_cpu_attention_does_not_have_is_refused():
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(NotImplementedError, match="sliding window"):
        varlen_attention(q, q, q, None, 2, sliding_window=4)
