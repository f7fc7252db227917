"""transformers 5.24.0, class 3 (a deviation from the kit's contract, not a defect): a
float64 Llama is only float32-accurate.

LlamaRMSNorm.forward casts its input to float32 (models/llama/modeling_llama.py:64), the
rotary tables are computed from float32 frequencies and positions (lines 106, 111), and eager
attention takes its softmax in float32 (line 197). For float16 and bfloat16 each is an upcast
on purpose, for numerical stability; for float64 a downcast. float64 is not a precision the
models are written for, so this is design, not a defect; the kit's adapters declare float32.

Plain transformers and torch. Run as `python repros/generate_float64_llama_is_float32_accurate.py`.
Exits 0.
"""

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
seen = "seen" if max(norm_error, rope_error) > 1e-12 else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): the float32 norm and "
    "rotations are deliberate; float64 is not a precision the models target"
)
