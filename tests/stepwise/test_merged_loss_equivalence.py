"""Prefix merging changes the layout, not the loss: on the same trajectory, a real causal LM gives the
same per-token log-probs, hence the same per-token PPO loss, on every loss token whether the turns
are trained as separate step rows (merge off) or as one merged row (merge on)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_traj.stepwise import broadcast_step_advantages, merge_trajectory_steps

VOCAB = 50


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).eval().to(torch.float64)


MODEL = _model()


def _response_log_probs(prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) for every response token, one forward pass."""
    ids = torch.cat([prompt, response]).unsqueeze(0)
    with torch.no_grad():
        logits = MODEL(input_ids=ids).logits[0, :-1].log_softmax(-1)
    targets = ids[0, 1:]
    lp = logits.gather(-1, targets[:, None])[:, 0]
    return lp[prompt.numel() - 1:]


def _ppo_token_loss(log_prob, old_log_prob, adv, clip=0.2):
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))


@given(seed=st.integers(0, 10_000), num_steps=st.integers(1, 5))
@settings(max_examples=25, deadline=None)
def test_merged_row_has_the_step_rows_per_token_loss(seed, num_steps):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, VOCAB, (int(n),), generator=g)  # noqa: E731
    prompts, responses = [rand(torch.randint(2, 6, (1,), generator=g))], []
    for i in range(num_steps):
        responses.append(rand(torch.randint(1, 5, (1,), generator=g)))
        if i + 1 < num_steps:  # next context = everything so far + an observation
            prompts.append(torch.cat([prompts[-1], responses[-1], rand(torch.randint(1, 4, (1,), generator=g))]))

    # merge off: one row per step; merge on: one row
    rows, stats = merge_trajectory_steps(prompts, responses)
    assert len(rows) == 1 and stats.loss_tokens_before == stats.loss_tokens_after
    merged = rows[0]

    step_lp = torch.cat([_response_log_probs(p, r) for p, r in zip(prompts, responses)])
    merged_lp = _response_log_probs(merged.prompt_ids, merged.response_ids)[merged.response_mask.bool()]
    torch.testing.assert_close(merged_lp, step_lp, rtol=0, atol=1e-10)

    # same trajectory advantage broadcast on each layout's own mask -> same per-token loss
    traj_adv = torch.tensor([0.7], dtype=torch.float64)
    adv_steps = torch.cat([broadcast_step_advantages(traj_adv, torch.zeros(1, dtype=torch.long),
                                                     torch.ones(1, r.numel()))[0] for r in responses])
    adv_merged = broadcast_step_advantages(traj_adv, torch.zeros(1, dtype=torch.long),
                                           merged.response_mask[None].double())[0][merged.response_mask.bool()]
    old = step_lp - 0.05 * torch.randn(step_lp.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(_ppo_token_loss(merged_lp, old, adv_merged.double()),
                               _ppo_token_loss(step_lp, old, adv_steps.double()), rtol=0, atol=1e-10)
