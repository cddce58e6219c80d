"""The transformers configuration of an nsa_titan model: every `[model]` setting by its nsa_titan name
(NSA's and the off-paper options included), with transformers' usual names as aliases.

This file is copied into every exported folder (`auto_map`); it needs transformers only.
"""

from transformers import PretrainedConfig


class NSATitanConfig(PretrainedConfig):
    model_type = "nsa_titan"
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                     "num_key_value_heads": "n_kv_groups", "rms_norm_eps": "norm_eps"}

    def __init__(self, max_position_embeddings: int = 2048, document_masking: bool = False,
                 rope_parameters: dict | None = None, **kwargs):
        """kwargs: the `[model]` settings (nsa_titan.config.Model's fields) but RoPE's, and transformers' own
        keys. `max_position_embeddings`: the longest context the model is declared for (the RoPE table's);
        `rope_parameters`: transformers' RoPE dict (rope_type default, linear or yarn; rope_theta, factor,
        ...); `document_masking`: an end-of-text token ends a document, as in training."""
        self.max_position_embeddings = max_position_embeddings
        self.document_masking = document_masking
        self.rope_parameters = rope_parameters
        super().__init__(**kwargs)
