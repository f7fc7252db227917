"""The tiny random Llama config the generate_*.py repros build their models from.

Not a repro: the generate_*.py scripts next to it import it (run as `python
repros/<name>.py`, the script's directory is on sys.path). Plain transformers, no kit.
"""

from transformers import LlamaConfig

PAD = 31


def tiny_llama_config(**overrides):
    """A 2-layer, 32-wide Llama config (vocab 32, no bos or eos, pad PAD), with overrides."""
    settings = dict(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)
