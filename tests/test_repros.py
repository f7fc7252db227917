"""The standalone repros of class 3 (a deviation from the kit's contract, not a defect) exit 0.

Each repro under repros/ states its class (docs/found-in-the-wild.md has the table); a class-3
repro shows the behaviour and exits 0 whether or not it is still there, so this checks that
each still runs on its engine's current API. Each is skipped with the reason where its engine
is not installed, so the default tier spends nothing here. The defect repros (classes 1 and
2) exit 1 while the defect is there and are not run here.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPROS = Path(__file__).resolve().parent.parent / "repros"
EXTRA = {
    "transformers": "pip install 'kvcache-verify[hf]'",
    "optimum.quanto": "pip install 'kvcache-verify[hf-quantized]'",
    "mlx_lm": "pip install 'kvcache-verify[mlx]'",
    "llama_cpp": "pip install 'kvcache-verify[llamacpp]'",
}
CLASS_3 = {
    "generate_float64_llama_is_float32_accurate.py": ("transformers",),
    "generate_offloaded_cache_cpu_crash.py": ("transformers",),
    "hf_dynamic_layer_half_applied_update.py": ("transformers",),
    "hf_dynamic_layer_promotes_dtype.py": ("transformers",),
    "hf_dynamic_layer_unequal_lengths.py": ("transformers",),
    "hf_static_layer_seq_length_live_tensor.py": ("transformers",),
    "hf_fp8_frozen_scale_clips.py": ("transformers",),
    "hf_quantized_non_tensor_key_attribute_error.py": ("transformers", "optimum.quanto"),
    "hf_quantized_promotes_dtype.py": ("transformers", "optimum.quanto"),
    "hf_quantized_refused_reorder_breaks.py": ("transformers", "optimum.quanto"),
    "hf_quantized_unequal_lengths.py": ("transformers", "optimum.quanto"),
    "hf_quanto_groups_straddle_tokens.py": ("transformers", "optimum.quanto"),
    "mlx_quantized_error_past_half_step.py": ("mlx_lm",),
    "mlx_rotating_half_applied_update.py": ("mlx_lm",),
    "mlx_rotating_refuses_trim_it_could_do.py": ("mlx_lm",),
    "mlx_trim_negative_count.py": ("mlx_lm",),
    "mlx_warm_cache_broadcasts_bad_rows.py": ("mlx_lm",),
    "llamacpp_flash_attention_f16.py": ("llama_cpp",),
    "llamacpp_shift_moves_copies.py": ("llama_cpp",),
    "serving_twin_adoption.py": ("sglang",),
}


def missing(module: str) -> str | None:
    """Why the engine ``module`` is not there, or None (found without importing it)."""
    if module == "sglang":
        where = os.environ.get("KVCHECK_SGLANG_PATH")
        if where and (Path(where) / "sglang" / "__init__.py").is_file():
            return None
        return (
            "SGLang's source is not installed: pip install --no-deps --target DIR "
            "sglang==0.5.23 and set KVCHECK_SGLANG_PATH=DIR"
        )
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} is not installed: {EXTRA[module]}"


def test_every_repro_is_listed_with_its_class():
    """A repro is either listed here (class 3) or says it is a defect (class 1 or 2)."""
    for path in sorted(REPROS.glob("[a-z]*.py")):
        text = path.read_text()
        assert ("class 3" in text) == (path.name in CLASS_3), path.name
        assert "class 1" in text or "class 2" in text or "class 3" in text, path.name


@pytest.mark.parametrize("name", sorted(CLASS_3))
def test_a_class_3_repro_exits_0(name):
    for module in CLASS_3[name]:
        reason = missing(module)
        if reason:
            pytest.skip(reason)
    run = subprocess.run(
        [sys.executable, str(REPROS / name)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPROS,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "class 3: deviation from the kit's contract, not a defect" in run.stdout
