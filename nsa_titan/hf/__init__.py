"""Hugging Face interop: nsa_titan's model as a transformers model (its own Transformer wrapped,
not rewritten), the export folder that `from_pretrained` and lm-evaluation-harness load, and the
cache `generate` uses. Needs the `[hf]` extra (transformers, lm-eval).

Importing this package registers the classes with transformers' Auto classes (as fla's models
do), so that in this process an export loads without `trust_remote_code`; elsewhere its folder's
`auto_map` names them.
"""

from __future__ import annotations

from ..system.extras import require_hf

require_hf("nsa_titan.hf")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from .configuration_nsa_titan import NSATitanConfig  # noqa: E402
from .modeling_nsa_titan import NSATitanForCausalLM  # noqa: E402

AutoConfig.register(NSATitanConfig.model_type, NSATitanConfig, exist_ok=True)
AutoModelForCausalLM.register(NSATitanConfig, NSATitanForCausalLM, exist_ok=True)
NSATitanConfig.register_for_auto_class()  # save_pretrained writes auto_map and copies the two files
NSATitanForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["NSATitanConfig", "NSATitanForCausalLM"]
