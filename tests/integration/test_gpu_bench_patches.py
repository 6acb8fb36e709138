"""What ``scripts/bench_update.py --device cuda`` (and the plugin, in every CUDA process) installs on a GPU without
flash-attn, checked on CPU in a fresh process (the patches are for the life of a process): the torch variable-length
attention under ``torch_varlen`` in transformers' registries and in verl's module, and the chunked fp32 log-softmax
for verl's engine log-probs, equal to verl's own fallback (the figures in docs/prefix_tree.md's update A/B rest on
both)."""

import os
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
from verl_traj.core.kernels.chunked_logprobs import chunked_logprobs
assert fi.logprobs_from_logits is chunked_logprobs and verl_fallback is logprobs_from_logits
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


# A process where verl_traj's plugin sees CUDA without flash-attn (forced here: VERL_TRAJ_TORCH_VARLEN=1, the CPU
# platform off): `import verl` only registers the torch_varlen names; verl's functions stay verl's (a stock run is
# untouched) until a model calls the torch_varlen attention, which installs the kernel and the chunked log-probs
PLUGIN = r'''
import torch
import verl  # loads the plugin
import verl.models.transformers.monkey_patch as mp
import verl.workers.engine.fsdp.transformer_impl as fi
import verl.utils.torch_functional as tf
import transformers.modeling_flash_attention_utils as fa
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface
from verl_traj.cpu.attention import varlen_attention
from verl_traj.cpu.plugin import register
from verl_traj.core.kernels.chunked_logprobs import chunked_logprobs

verl_kernel = mp._flash_attention_forward
assert register() is False  # not the CPU platform
assert "torch_varlen" in AttentionInterface._global_mapping and "torch_varlen" in AttentionMaskInterface._global_mapping
assert "cpu_varlen" not in AttentionInterface._global_mapping
assert verl_kernel is fa._flash_attention_forward  # verl's own (transformers' function), untouched
assert fi.logprobs_from_logits is tf.logprobs_from_logits  # verl's own, untouched
try:  # a model selecting torch_varlen: its first attention call (bogus arguments fail after the install)
    AttentionInterface._global_mapping["torch_varlen"](None, None, None, None, None)
except Exception:
    pass
assert mp._flash_attention_forward is varlen_attention and fi.logprobs_from_logits is chunked_logprobs
print("checked")
'''


def test_the_plugin_gives_a_cuda_process_without_flash_attn_torch_varlen():
    env = {**os.environ, "VERL_TRAJ_CPU": "0", "VERL_TRAJ_TORCH_VARLEN": "1"}
    run = subprocess.run([sys.executable, "-c", PLUGIN], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "checked" in run.stdout, run.stderr[-3000:]
