"""Tiny random-weight targets (Llama and Qwen2 families) and draft heads that accept often.

A random head almost never guesses right, which would leave multi-token acceptance, EOS inside an
accepted path and max_new_tokens mid-path untested. So `tiny_pair` damps the target's attention
and its second layer, and builds the head from the target's own first layer with an FC that
passes the token embedding through: the head then predicts the target's next token most of the
time, but not always (context still matters a little), which exercises every branch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from eaglespec.spec.head import EagleDraftHead
from eaglespec.train.extract import ExtractConfig, extract

torch.set_num_threads(1)  # tiny models: one thread is fastest and immune to contention

SHARED = Path(__file__).resolve().parents[2] / "shared"
# EAGLESPEC_TEST_DEVICE=cuda runs the tiny-model engine tests on a GPU (tests/test_cuda.py always does)
DEVICE = os.environ.get("EAGLESPEC_TEST_DEVICE", "cpu")


def tiny_target(family: str = "llama", seed: int = 0, vocab: int = 128, attn_scale: float = 0.3,
                layers: int = 2, max_pos: int = 512, device: str = DEVICE):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, attn_implementation="sdpa"))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5) if p.dim() > 1 else None
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.mul_(attn_scale)
            if i > 0:
                layer.mlp.down_proj.weight.mul_(0.1)
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()


def good_head(model) -> EagleDraftHead:
    head = EagleDraftHead(model.config).bind(model)
    h = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:] = torch.eye(h)
        head.fc.bias.zero_()
        head.layers[0].load_state_dict(model.model.layers[0].state_dict())
    return head.eval()


def trained_head(model, arch: str = "eagle3", prompts: list[list[int]] = (), aux_layers: list[int] | None = None,
                 steps: int = 200, seed: int = 0) -> EagleDraftHead:
    """A head of `arch` trained for a moment on the tiny target's own greedy text after `prompts`
    (and a few random ones): an eagle3 head cannot be built by hand to accept (its residual stream
    never sees the token's embedding), and a tiny random target's text is learnt by heart, not in
    general, so a test that wants acceptance decodes the prompts the head trained on."""
    from eaglespec.train.trainer import eagle_loss

    torch.manual_seed(seed)
    aux = aux_layers if aux_layers is not None else ([0, 1, 2] if arch == "eagle3" else [])
    prompts = list(prompts) + torch.randint(2, model.config.vocab_size, (8, 4)).tolist()
    n, width = 40, max(len(p) for p in prompts) + 40
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=model.device)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool, device=model.device)
    feats = torch.zeros(len(prompts), width, model.config.hidden_size * (1 + len(aux)), device=model.device)
    with torch.no_grad():
        for r, p in enumerate(prompts):
            x = torch.tensor([p], device=model.device)
            seq = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones_like(x))
            hs = model.model(input_ids=seq, output_hidden_states=True).hidden_states
            t = seq.shape[1]
            ids[r, :t], mask[r, len(p):t] = seq[0], True
            feats[r, :t] = torch.cat([hs[-1]] + [hs[i] for i in aux], -1)[0]
    head = EagleDraftHead(model.config, arch=arch, aux_layers=aux).bind(model).warm_start(model)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = eagle_loss(head, ids, feats, mask, noise=0.0, ce_weight=1.0, unroll=2, unroll_fraction=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(params=["llama", "qwen2"])
def tiny_pair(request):
    model = tiny_target(request.param)
    return model, good_head(model)


@pytest.fixture
def random_head_pair():
    model = tiny_target("llama", seed=3)
    torch.manual_seed(5)
    return model, EagleDraftHead(model.config).bind(model).eval()


def save_tiny_dir(root: Path) -> Path:
    """A tiny model + word-level tokenizer (with a chat template) + good head on disk, for CLI tests."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_target("llama", device="cpu")
    model.save_pretrained(root / "model")
    vocab = {f"w{i}": i for i in range(128)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="w1", unk_token="w0", pad_token="w0")
    tok.chat_template = ("{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}"
                         "{% if add_generation_prompt %}w4{% endif %}")
    tok.save_pretrained(root / "model")
    good_head(model).save_pretrained(root / "head")
    return root


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = save_tiny_dir(tmp_path_factory.mktemp("tiny"))
    good_head(tiny_target("llama", vocab=64, device="cpu")).save_pretrained(root / "head_small_vocab")
    return root


@pytest.fixture(scope="module")
def tiny_features(tmp_path_factory):
    root = save_tiny_dir(tmp_path_factory.mktemp("trainfeat"))
    g = torch.Generator().manual_seed(0)
    lines = []
    for i in range(40):
        turns = []
        for k in range(4):
            words = " ".join(f"w{int(t)}" for t in torch.randint(5, 128, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g))
            turns.append({"from": "human" if k % 2 == 0 else "gpt", "value": words})
        lines.append(json.dumps({"conversations": turns}))
    (root / "convs.jsonl").write_text("\n".join(lines))
    cfg = ExtractConfig(model=str(root / "model"), out_dir=str(root / "feats"), data=str(root / "convs.jsonl"),
                        max_len=64, max_tokens=10_000, heldout=4, conversations_per_shard=8)
    rep = extract(cfg)
    assert rep["train"]["tokens"] > 0
    return root
