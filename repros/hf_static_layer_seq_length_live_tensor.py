"""transformers 5.24.0, class 3 (a deviation from the kit's contract, not a defect):
StaticLayer.get_seq_length(), annotated -> int, returns its live cumulative_length tensor.

get_seq_length returns self.cumulative_length (cache_utils.py:504), which update changes in
place (add_, line 483): a length read before an update reads as the new length afterwards.
By design: the source keeps it a tensor on purpose ("Very important that it's a tensor here,
to avoid recompiling", line 421), and on issue #45987 a maintainer asked for the type hint
to be widened rather than for an .item() call, which would force a device sync
(https://github.com/huggingface/transformers/issues/45987). A caller that keeps a length
must take int() of it.

Plain transformers and torch. Run as `python repros/hf_static_layer_seq_length_live_tensor.py`.
Exits 0.
"""

import torch
from transformers.cache_utils import StaticLayer

layer = StaticLayer(max_cache_len=8)
rows = torch.zeros(1, 1, 2, 4)
layer.update(rows, rows)
before = layer.get_seq_length()
layer.update(rows, rows)
print(f"get_seq_length() returned {type(before).__name__}; read after one more update: {before}")
seen = "seen" if int(before) == 4 else "no longer seen"
print(
    f"class 3: deviation from the kit's contract, not a defect ({seen}): the length is a tensor on "
    "purpose (torch.compile), see transformers issue #45987"
)
