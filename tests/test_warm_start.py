"""The shared supervised warm start: padding/labels alignment and that it actually learns."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_traj.cpu.warm_start import pad_examples, supervised_warm_start


def test_pad_examples_right_pads_and_masks_labels():
    ids, attn, labels = pad_examples([([5, 6, 7], [-100, 6, 7]), ([8], [8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [[-100, 6, 7], [8, -100, -100]]
    with pytest.raises(ValueError, match="example 0: 2 token ids but 1 labels"):
        pad_examples([([1, 2], [1])], pad_id=0)


def test_warm_start_learns_the_trained_tokens_only():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    seq = [3, 9, 4, 17, 5, 21]
    example = lambda: (seq, [-100, -100, 4, 17, 5, 21])  # noqa: E731  (no loss on the "prompt")
    losses = supervised_warm_start(model, example, steps=40, lr=1e-2, pad_id=0, batch_size=4, warmup_steps=5,
                                   decay=True, clip_grad=1.0)
    assert len(losses) == 40 and losses[-1] < 0.1 * losses[0]
    with torch.no_grad():
        pred = model(input_ids=torch.tensor([seq])).logits[0].argmax(-1).tolist()
    assert pred[1:5] == seq[2:6]  # it continues the trained part of the sequence
