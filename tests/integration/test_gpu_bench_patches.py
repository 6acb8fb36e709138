"""What ``scripts/bench_update.py --device cuda`` installs on a GPU without flash-attn, checked on CPU in a fresh
process (the patches are for the life of a process): the torch variable-length attention under ``torch_varlen`` in
transformers' registries and in verl's module, and one vectorised fp32 log-softmax for verl's engine log-probs, equal
to verl's own fallback (the figures in docs/prefix_tree.md's update A/B rest on both)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = r'''
import importlib.util
import torch
import verl.models.transformers.monkey_patch as mp
import verl.workers.engine.fsdp.transformer_impl as fi
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface
from verl.utils.torch_functional import logprobs_from_logits
from verl_traj.cpu.attention import varlen_attention
from verl_traj.testing.engine import register_torch_varlen

spec = importlib.util.spec_from_file_location("bench_update", "scripts/bench_update.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
verl_fallback = fi.logprobs_from_logits
bench._install_fused_logprobs()
assert fi.logprobs_from_logits is bench.fused_logprobs and verl_fallback is logprobs_from_logits
logits, labels = torch.randn(3, 7, 13, dtype=torch.float64), torch.randint(0, 13, (3, 7))
torch.testing.assert_close(fi.logprobs_from_logits(logits, labels), verl_fallback(logits.float(), labels),
                           rtol=1e-6, atol=1e-6)
name = register_torch_varlen()
assert name == register_torch_varlen() == "torch_varlen"  # idempotent
assert name in AttentionInterface._global_mapping and name in AttentionMaskInterface._global_mapping
assert mp._flash_attention_forward is varlen_attention
print("checked")
'''


def test_the_gpu_benchmark_patches_hold_on_cpu():
    run = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "checked" in run.stdout, run.stderr[-3000:]
