"""transformers 5.24.0: a float64 Llama computes in float32 where it means to upcast.
LlamaRMSNorm.forward casts its input .to(torch.float32) (models/llama/modeling_llama.py:64),
LlamaRotaryEmbedding computes cos and sin from float32 frequencies and float32 positions
(lines 106, 111), and eager_attention_forward takes the softmax in float32 (line 197): for
float16 and bfloat16 each is an upcast, for float64 a downcast. A float64 model is then only
float32-accurate: its logits are about 1e-6 from a float64 computation, where float64
rounding would leave about 1e-14.

Exits 1 while the defect is there: the norm of a float64 tensor differs from the same
formula computed in float64 by more than float64 rounding.
"""

import sys

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

torch.manual_seed(0)
x = torch.randn(4, 64, dtype=torch.float64)
norm = LlamaRMSNorm(64, eps=1e-6).to(torch.float64)
theirs = norm(x)
ours = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
norm_error = (theirs - ours).abs().max().item()

config = LlamaConfig(
    hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=4096
)
rope = LlamaRotaryEmbedding(config).to(torch.float64)
positions = torch.arange(0, 4096, 97)[None]
cos, _ = rope(x, positions)
inverse = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
angles = positions[0].to(torch.float64)[:, None] * inverse
rope_error = (cos[0, :, :8] - angles.cos()).abs().max().item()
print(f"float64 RMSNorm vs the formula in float64: {norm_error:.2e}")
print(f"float64 RoPE cos vs the formula in float64: {rope_error:.2e}")
if norm_error > 1e-12 or rope_error > 1e-12:
    print("DEFECT: a float64 Llama computes its norm and rotations in float32")
    sys.exit(1)
print("fixed")
