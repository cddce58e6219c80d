"""The transformers configuration of an nsa_titan model: every `[model]` setting by its nsa_titan name
(NSA's and the off-paper options included), with transformers' usual names as aliases.

This file is copied into every exported folder (`auto_map`); it needs transformers only.
"""

from transformers import PretrainedConfig


class NSATitanConfig(PretrainedConfig):
    model_type = "nsa_titan"
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "num_key_value_heads": "n_kv_groups", "rms_norm_eps": "norm_eps"}

    def __init__(self, max_position_embeddings: int = 2048, document_masking: bool = False, **kwargs):
        """kwargs: the `[model]` settings (nsa_titan.config.Model's fields) and transformers' own keys.
        `max_position_embeddings`: the training sequence length (the RoPE table's); `document_masking`:
        an end-of-text token ends a document, as in training (attention does not cross it)."""
        self.max_position_embeddings = max_position_embeddings
        self.document_masking = document_masking
        super().__init__(**kwargs)
