"""nsa_titan's Transformer as a transformers causal LM: `from_pretrained`, `generate` (NSA's per-branch
KV cache behind the cache argument), lm-evaluation-harness. The model is nsa_titan's own
(`nsa_titan.models.transformer.Transformer`): the NSA maths is not written a second time.

This file is copied into every exported folder (`auto_map`); it needs the nsa_titan package.
"""

import copy
import dataclasses
import weakref

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from nsa_titan.config import Model
from nsa_titan.data.batch import document_ids, document_starts
from nsa_titan.models.decode import DecodeCache, Decoder
from nsa_titan.models.rope import rope_settings, rope_tables
from nsa_titan.models.transformer import Transformer
from nsa_titan.runtime.kernel_check import verified_decode
from nsa_titan.runtime.kernel_timing import timed_context

from .configuration_nsa_titan import NSATitanConfig

CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
"""The output's cache field in this transformers version (`cache` since 5.2x, `past_key_values` before)."""
MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)
"""The generate() modes NSA's cache serves."""
WHAT_WORKS = ("greedy or sampled decoding (do_sample, seeded by torch.manual_seed), beam search (num_beams, "
              "num_return_sequences), and a follow-up generate() given the returned cache")


def model_config(config: NSATitanConfig) -> Model:
    """nsa_titan's `[model]` section of an HF config (defaults for settings it lacks)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(Model) if hasattr(config, f.name)}
    return Model(**{**fields, **rope_settings({"rope_parameters": config.rope_parameters})})


class NSATitanForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NSATitanConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock"]
    _tied_weights_keys = {"model.output.weight": "model.tok_embeddings.weight"}

    def __init__(self, config: NSATitanConfig):
        super().__init__(config)
        self.model = Transformer(model_config(config), config.max_position_embeddings)
        self.decode_kernels: dict[tuple[torch.device, torch.dtype, int], str] = {}
        self.last_request: tuple[weakref.ref, Decoder] | None = None  # the last generate()'s cache and decoder
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own DecodeCache (cmp, sel and win keys per layer)

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Only what a checkpoint does not hold: the RoPE table (a buffer it does not save)."""
        if isinstance(module, Transformer):
            module.rope.copy_(rope_tables(module.cfg, module.max_seq_len, module.rope.device))

    def decode_kernel(self, context: int = 0) -> str:
        """The decoding step's kernel where the model is (the config's `decode_kernels`), checked there once against
        the model's forward (`verify_kernels`; a machine's verdict is kept); with a request's `context`, `auto` takes
        the fastest step timed at that length (`kernel_timing.timed_context`; kept too)."""
        weight = self.model.output.weight
        where = (weight.device, weight.dtype, timed_context(context) if context else 0)
        if where not in self.decode_kernels:
            self.decode_kernels[where] = verified_decode(self.model.cfg, *where[:2], context=context)
        return self.decode_kernels[where]

    def generate(self, *args, generation_config: GenerationConfig | None = None, **kwargs):
        """transformers' generate() in the modes NSA's cache serves (`MODES`); another is refused in one line."""
        config = copy.deepcopy(generation_config or self.generation_config)
        config.update(**kwargs)
        mode = config.get_generation_mode(kwargs.get("assistant_model"))
        if mode not in MODES and kwargs.get("custom_generate") is None:
            raise ValueError(f"generate(): {mode.value.replace('_', ' ')} is not supported with NSA's cache; what "
                             f"works: {WHAT_WORKS}")
        return super().generate(*args, generation_config=generation_config, **kwargs)

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict,
                                      generation_mode: GenerationMode, batch_size: int, max_cache_length: int) -> None:
        """generate()'s cache: NSA's, sized to the request (its longest prompt and new tokens: `max_cache_length`
        positions a row), the last request's buffers reused where its cache is gone; one handed in (a follow-up
        turn) grows to it. A request past the declared maximum is refused before anything is allocated."""
        if max_cache_length > self.model.max_seq_len:
            raise ValueError(f"generate(): the longest prompt and max_new_tokens need {max_cache_length:,} positions "
                             f"a row, past the {self.model.max_seq_len:,} this model is declared for "
                             "(max_position_embeddings): shorten them, or adapt the model to a longer context "
                             "(docs/long-context.md)")
        given = model_kwargs.get(CACHE_FIELD)
        if isinstance(given, DecodeCache) and given.beams:
            raise ValueError("generate(): the cache handed in was reordered by beam search: its rows are the beams of "
                             "its last step, not the sequences it returned (those may have ended earlier, in another "
                             "order). Run the follow-up without it (the conversation is prefilled again), or hand "
                             "back caches of greedy or sampled turns")
        if given is not None:
            rows = max(generation_config.num_beams, generation_config.num_return_sequences) * batch_size
            if not isinstance(given, DecodeCache) or len(given.decoder.at) != rows:
                held = f"{len(given.decoder.at)} rows" if isinstance(given, DecodeCache) else type(given).__name__
                raise ValueError(f"generate(): the cache handed in ({held}) is not this request's: give back the "
                                 f"cache a generate() of the same {batch_size} prompts returned (num_beams = 1, "
                                 "num_return_sequences = 1), or none")
            given.decoder.reserve(max_cache_length)
        elif generation_config.use_cache is not False:
            last, self.last_request = self.last_request, None  # the old buffers: this request's, or freed
            spare = last[1].caches if last is not None and last[0]() is None else None
            cache = DecodeCache(self.model, self.decode_kernel(max_cache_length), max_cache_length, spare)
            self.last_request = (weakref.ref(cache), cache.decoder)
            model_kwargs[CACHE_FIELD] = cache

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_embeddings

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.output

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: DecodeCache | None = None, past_key_values: DecodeCache | None = None,
                use_cache: bool | None = None, labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                **kwargs):
        """Logits (B, T, vocab) of input_ids (B, T) (with `logits_to_keep`, as `generate` asks, of the last
        positions only). With `use_cache` (as `generate` calls it) or a cache
        given, the first call prefills a DecodeCache and later calls extend it by their new tokens.
        `attention_mask` zeros (padding, left or right) are documents of their own; with the config's
        `document_masking`, so is each end-of-text-terminated document, as in training."""
        cache = cache if cache is not None else past_key_values
        eos = self.config.eos_token_id if self.config.document_masking else None
        if cache is None and use_cache:
            cache = DecodeCache(self.model, self.decode_kernel())
        if cache is None:
            logits = self.model(input_ids, document_ids(input_ids, attention_mask, eos))
            logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        elif cache.seen == 0:
            if attention_mask is not None and not bool(attention_mask[:, -1].all()):
                raise ValueError("a prompt ends in padding (right padding): new tokens would follow the padding. "
                                 "Pad on the left (tokenizer.padding_side = 'left'), as for any decoder-only model")
            logits = cache.forward(input_ids, document_ids(input_ids, attention_mask, eos), logits_to_keep)
        else:  # a step, or a follow-up turn: its padding and end-of-text start documents, as the full forward's
            previous = cache.decoder.last if cache.decoder.last is not None else input_ids[:, :1]
            starts = document_starts(input_ids, previous, attention_mask, eos)
            logits = cache.forward(input_ids, keep=logits_to_keep, starts=starts)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
