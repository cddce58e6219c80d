"""transformers' generate() on nsa_titan's Hugging Face class, as users run it: NSA's cache sized to the request
and reused by the next, beam search, sampling with a seed, a follow-up turn on the returned cache, and the modes
that are refused. In-process, fp32, random weights (lm-eval's generate_until at batch 8: tests/test_hf.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, StaticCache  # noqa: E402

from nsa_titan.config import Model  # noqa: E402
from nsa_titan.generate import request_decoder  # noqa: E402
from nsa_titan.hf import NSATitanForCausalLM  # noqa: E402
from nsa_titan.hf.export import model_config  # noqa: E402
from nsa_titan.hf.modeling_nsa_titan import CACHE_FIELD  # noqa: E402
from nsa_titan.models.decode_cache import request_context  # noqa: E402

VOCAB, EOS = 256, 255
SMALL = dict(cmp_block_size=8, cmp_stride=4, sel_block_size=8, sel_top_n=4, window_size=16)
"""Block sizes that put every branch to work within a few dozen tokens."""


def hf_model(attention: str = "nsa", declared: int = 128, **sizes) -> NSATitanForCausalLM:
    """The class an export loads, 2 layers of dim 64 (4 heads, 2 KV groups, head dim 16), seeded weights."""
    cfg = Model(attention=attention, dim=64, n_layers=2, n_heads=4, n_kv_groups=2, head_dim=16, vocab_size=VOCAB,
                **sizes)
    model = NSATitanForCausalLM(model_config(cfg, declared, eos_token_id=EOS, pad_token_id=EOS))
    model.model.init_weights(0)
    return model.eval()


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of `lengths` random tokens (no end-of-text), left-padded into one batch, and its attention mask."""
    gen, width = torch.Generator().manual_seed(seed), max(lengths)
    rows = [torch.randint(0, EOS, (n,), generator=gen) for n in lengths]
    ids = torch.stack([torch.cat([torch.full((width - len(r),), EOS), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
                        for n in lengths])
    return ids, mask


def static_bytes(length: int, rows: int) -> int:
    """What transformers' StaticCache of a dense model of the same layers, KV heads and head dim holds for
    `length` positions a row, in fp32."""
    cache = StaticCache(config=LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=16, hidden_size=64), max_cache_len=length)
    cache.early_initialization(rows, 2, 16, torch.float32, torch.device("cpu"))
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
@pytest.mark.slow
def test_the_cache_holds_what_the_request_needs_not_the_declared_context():
    """A model declared for 32k at the paper's block sizes: a 100-token prompt and 50 new tokens allocate for 149
    positions, not 32,768 (NSA holds three key/value sets: sel's every position, the window's last w, and the
    compressed blocks with the cmp ring: below w, more than twice a dense cache of one set); a 16k prompt's cache is
    within 1.1x a dense static cache of the same length."""
    model = hf_model(declared=32768)
    for prompt, bound in ((100, 3.05), (16384, 1.1)):
        ids = torch.randint(0, EOS, (1, prompt), generator=torch.Generator().manual_seed(prompt))
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=50, min_new_tokens=50,
                             do_sample=False, return_dict_in_generate=True)
        cache, length = getattr(out, CACHE_FIELD), prompt + 49  # the last new token is never fed back
        assert cache.decoder.context == request_context(model.model, length) < length + 64
        assert cache.decoder.nbytes() <= bound * static_bytes(length, 1), (prompt, cache.decoder.nbytes())
        if prompt == 100:  # before: every row held the declared 32k, more than a dense cache of 32k does
            assert cache.decoder.nbytes() < static_bytes(32768, 1) / 50


@torch.no_grad()
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_beam_search_equals_uncached_beam_search_token_for_token(attention):
    """4 beams, 2 sequences returned, over 3 prompts of different lengths in one left-padded batch: NSA's cache
    reordered beam by beam gives the sequences (and scores) of the same search over full forwards."""
    model = hf_model(attention, **SMALL)
    ids, mask = left_padded([5, 21, 37])
    search = dict(max_new_tokens=20, min_new_tokens=20, num_beams=4, num_return_sequences=2, do_sample=False,
                  return_dict_in_generate=True, output_scores=True)
    cached = model.generate(ids, attention_mask=mask, **search)
    uncached = model.generate(ids, attention_mask=mask, use_cache=False, **search)
    assert cached.sequences.shape == (6, 37 + 20)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, rtol=1e-5, atol=1e-5)
    assert len({tuple(row) for row in cached.sequences[:, 37:].tolist()}) == 6  # two different beams a prompt


@torch.no_grad()
def test_sampling_with_a_seed_repeats_and_equals_uncached_sampling():
    model = hf_model(**SMALL)
    ids, mask = left_padded([9, 30], seed=1)
    sample = dict(max_new_tokens=24, min_new_tokens=24, do_sample=True, top_k=50, temperature=0.9,
                  num_return_sequences=2)
    runs = []
    for use_cache in (True, True, False):
        torch.manual_seed(7)
        runs.append(model.generate(ids, attention_mask=mask, use_cache=use_cache, **sample))
    assert runs[0].shape == (4, 30 + 24) and torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    torch.manual_seed(8)
    assert not torch.equal(model.generate(ids, attention_mask=mask, **sample), runs[0])


@torch.no_grad()
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_a_follow_up_turn_on_the_returned_cache_equals_the_whole_conversation_at_once(attention):
    """A chat continuation: the first turn's cache, handed back with the conversation and the user's next tokens,
    grows to the new request and gives the tokens a generate() of the whole conversation gives."""
    model = hf_model(attention, **SMALL)
    ids, mask = left_padded([7, 26], seed=2)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                           return_dict_in_generate=True)
    cache = getattr(first, CACHE_FIELD)
    held = cache.decoder.context
    user = torch.randint(0, EOS, (2, 12), generator=torch.Generator().manual_seed(3))
    talk = torch.cat([first.sequences, user], 1)
    talk_mask = torch.cat([mask, torch.ones(2, 10 + 12, dtype=torch.long)], 1)
    turn = dict(attention_mask=talk_mask, max_new_tokens=15, min_new_tokens=15, do_sample=False)
    follow_up = model.generate(talk, **turn, **{CACHE_FIELD: cache})
    assert cache.decoder.context == request_context(model.model, talk.shape[1] + 14) > held
    assert torch.equal(follow_up, model.generate(talk, **turn))


@torch.no_grad()
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_a_follow_up_after_padding_and_end_of_text_equals_the_whole_conversation_at_once(attention):
    """Document masking on: row 0 ends its first turn early (its end-of-text at the 3rd new token, padding after it,
    masked out in the conversation handed back), row 1's next user turn holds an end-of-text. The cached follow-up
    read neither the mask nor the end-of-text after the prefill, where a forward of the whole conversation starts
    a document; now both give the same tokens."""
    model = hf_model(attention, **SMALL)
    ids, mask = left_padded([7, 26], seed=2)
    turn1 = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    eos = int(model.generate(ids, **turn1, min_new_tokens=10)[0, 26 + 2])  # row 0's 3rd new token: its end-of-text
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.config.document_masking = True
    first = model.generate(ids, **turn1, eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True)
    seq = first.sequences
    assert (seq[0, 26 + 3:] == eos).all() and seq.shape[1] == 36  # row 0 ended; row 1 went on
    user = torch.randint(0, EOS, (2, 12), generator=torch.Generator().manual_seed(3))
    user[1, 5] = eos
    talk = torch.cat([seq, user], 1)
    talk_mask = torch.cat([mask, torch.ones(2, 10 + 12, dtype=torch.long)], 1)
    talk_mask[0, 26 + 3:36] = 0  # the padding after row 0's end-of-text
    turn = dict(attention_mask=talk_mask, max_new_tokens=15, min_new_tokens=15, do_sample=False, eos_token_id=eos,
                pad_token_id=eos, return_dict_in_generate=True, output_logits=True)
    follow_up = model.generate(talk, **turn, **{CACHE_FIELD: getattr(first, CACHE_FIELD)})
    whole = model.generate(talk, **turn)
    assert torch.equal(follow_up.sequences, whole.sequences)
    torch.testing.assert_close(torch.stack(follow_up.logits), torch.stack(whole.logits), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_a_cache_returned_by_beam_search_is_refused_for_a_follow_up():
    """Its rows are the beams of the last step, not the sequences returned (4 beams, 4 returned: the same count of
    rows, so the size check let it through, misaligned)."""
    model = hf_model(**SMALL)
    ids, mask = left_padded([5, 9])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=4, num_return_sequences=4,
                         do_sample=False, return_dict_in_generate=True)
    talk = torch.cat([out.sequences, torch.ones(8, 3, dtype=torch.long)], 1)
    with pytest.raises(ValueError, match=r"generate\(\): the cache handed in was reordered by beam search: .*Run the "
                                         r"follow-up without it"):
        model.generate(talk, attention_mask=torch.ones_like(talk), max_new_tokens=4, do_sample=False,
                       **{CACHE_FIELD: getattr(out, CACHE_FIELD)})


@torch.no_grad()
def test_consecutive_requests_reuse_the_buffers_unless_the_cache_is_kept():
    """Two requests of the same sizes: the second writes the first's buffers (not zeroed) and equals a fresh
    model's; a cache the caller kept is never handed to another request, and continues as if alone."""
    model, fresh = hf_model(**SMALL), hf_model(**SMALL)
    a, mask_a = left_padded([12, 20], seed=4)
    b, mask_b = left_padded([20, 17], seed=5)
    greedy = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    model.generate(a, attention_mask=mask_a, **greedy)
    pointers = lambda: [buf.data_ptr() for c in model.last_request[1].caches for buf in c.buffers.values()]  # noqa
    first = pointers()
    out = model.generate(b, attention_mask=mask_b, **greedy)
    assert pointers() == first and torch.equal(out, fresh.generate(b, attention_mask=mask_b, **greedy))
    kept = getattr(model.generate(a, attention_mask=mask_a, return_dict_in_generate=True, **greedy), CACHE_FIELD)
    model.generate(b, attention_mask=mask_b, **greedy)  # the kept cache is alive: new buffers for this one
    assert not set(pointers()) & {buf.data_ptr() for c in kept.decoder.caches for buf in c.buffers.values()}
    again = fresh.generate(a, attention_mask=mask_a, return_dict_in_generate=True, **greedy)
    nxt = torch.full((2, 1), 3)
    alone = fresh(nxt, **{CACHE_FIELD: getattr(again, CACHE_FIELD)}).logits
    assert torch.equal(model(nxt, **{CACHE_FIELD: kept}).logits, alone)


@torch.no_grad()
def test_requests_past_the_declared_context_and_unsupported_modes_are_refused_in_one_line():
    model = hf_model(**SMALL)  # declared for 128
    ids, mask = left_padded([100, 40])
    with pytest.raises(ValueError, match=r"need 129 positions a row, past the 128 this model is declared for"):
        model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert model.last_request is None  # refused before any cache was made
    refused = {"assisted generation": dict(assistant_model=model),
               "contrastive search": dict(penalty_alpha=0.6, top_k=4),
               "group beam search": dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
               "constrained beam search": dict(num_beams=2, force_words_ids=[[5]])}
    for mode, kwargs in refused.items():
        with pytest.raises(ValueError) as e:
            model.generate(ids, attention_mask=mask, max_new_tokens=4, **kwargs)
        assert f"{mode} is not supported with NSA's cache" in str(e.value) and "beam search (num_beams" in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"the cache handed in \(DynamicCache\) is not this request's"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, **{CACHE_FIELD: DynamicCache()})


def test_the_cli_sizes_its_caches_by_the_same_rule():
    """`python -m nsa_titan.generate` decodes through the same Decoder, sized by the same rule as generate()."""
    model = hf_model(**SMALL).model
    decoder = request_decoder(model, [[1] * 30, [2] * 9], 20, "auto")
    assert decoder.context == request_context(model, 30 + 19) == 56
