"""Training: the loss by hand, the shift, the mask, eval without noise, exact resume, bad shards."""

import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eaglespec.errors import CheckpointError, EaglespecError
from eaglespec.spec.head import EagleDraftHead
from eaglespec.train.data import render, stream_json_array, to_messages
from eaglespec.train.extract import ExtractConfig, extract, read_shard
from eaglespec.train.trainer import (Sequences, draft_vocabulary, eagle_loss, train,
                                     unroll_accuracy, unroll_anchors)

from eaglespec.train.trainer import TrainConfig as _TrainConfig

from conftest import tiny_target


def TrainConfig(**kw) -> _TrainConfig:
    """The trainer's settings with the hybrid head unless a test names another: these tests drive
    the loop on a 2-layer tiny target, too shallow for EAGLE-3's default layers (2, L // 2, L - 3)."""
    return _TrainConfig(**{"arch": "hybrid", **kw})


@pytest.fixture
def head_and_batch():
    model = tiny_target("llama", seed=2)
    torch.manual_seed(0)
    head = EagleDraftHead(model.config).bind(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (2, 7), generator=g)
    feats = torch.randn(2, 7, 64, generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    return model, head, ids, feats, mask


def test_loss_matches_hand_computation_and_shift(head_and_batch):
    model, head, ids, feats, mask = head_and_batch
    loss, info = eagle_loss(head, ids, feats, mask, noise=0.0, ce_weight=0.1)
    # by hand, one position at a time: input (f_j, t_{j+1}) for j < 6, target f_{j+1}
    regs, ces = [], []
    for b in range(2):
        pos = torch.arange(6)[None]
        pred = head(feats[b:b + 1, :-1], ids[b:b + 1, 1:], pos)[0]
        for j in range(6):
            if not mask[b, j + 1]:
                continue
            regs.append(F.smooth_l1_loss(pred[j], feats[b, j + 1]))
            p = model.lm_head(feats[b, j + 1]).softmax(-1)
            ces.append(-(p * model.lm_head(pred[j]).log_softmax(-1)).sum())
    want = torch.stack(regs).mean() + 0.1 * torch.stack(ces).mean()
    torch.testing.assert_close(loss, want)
    assert info["tokens"] == int(mask[:, 1:].sum())
    # EAGLE-3's loss: no feature regression, CE alone
    ce_only, _ = eagle_loss(head, ids, feats, mask, noise=0.0, ce_weight=1.0, reg_weight=0.0)
    torch.testing.assert_close(ce_only, torch.stack(ces).mean())


@pytest.mark.parametrize("ce, reg, msg", [(-0.1, 1.0, "ce_weight must be >= 0"), (0.1, -1.0, "reg_weight must be >= 0"),
                                          (0.0, 0.0, "nothing to train on")])
def test_loss_weights_are_checked(ce, reg, msg):
    with pytest.raises(EaglespecError, match=msg):
        TrainConfig(features="f", out="o", ce_weight=ce, reg_weight=reg).validate()


def test_shift_feature_j_pairs_with_token_j_plus_1(head_and_batch):
    """Changing t_{j+1} must change the prediction at position j (and nothing before it)."""
    _, head, ids, feats, mask = head_and_batch
    pos = torch.arange(6)[None]
    a = head(feats[:1, :-1], ids[:1, 1:], pos)
    ids2 = ids.clone()
    ids2[0, 4] = (ids2[0, 4] + 1) % 128  # t_4 is the input token at position j = 3
    b = head(feats[:1, :-1], ids2[:1, 1:], pos)
    assert torch.equal(a[0, :3], b[0, :3]) and not torch.allclose(a[0, 3], b[0, 3])


def test_masked_positions_carry_no_loss(head_and_batch):
    _, head, ids, feats, mask = head_and_batch
    cut = mask.clone()
    cut[0, 6] = False  # f_6 is only ever a target (never an input): mask its position out
    l1, _ = eagle_loss(head, ids, feats, cut, 0.0, 0.1)
    feats2 = feats.clone()
    feats2[0, 6] += 100.0
    l2, _ = eagle_loss(head, ids, feats2, cut, 0.0, 0.1)
    torch.testing.assert_close(l1, l2)
    l3, _ = eagle_loss(head, ids, feats2, mask, 0.0, 0.1)
    assert not torch.allclose(l1, l3)  # unmasked, the same change does count


def test_noise_only_in_training(head_and_batch, monkeypatch):
    model, head, ids, feats, mask = head_and_batch
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    a, _ = eagle_loss(head, ids, feats, mask, 0.1, 0.1, g1)
    b, _ = eagle_loss(head, ids, feats, mask, 0.1, 0.1, g2)
    assert not torch.allclose(a, b)  # noise is really applied in training
    seqs = Sequences(ids=[ids[0]], feats=[feats[0]], mask=[mask[0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: (_ for _ in ()).throw(AssertionError("noise at eval")))
    r1 = unroll_accuracy(head, seqs, 1, 3)
    assert r1 == unroll_accuracy(head, seqs, 1, 3) and len(r1) == 3


def test_unroll_step1_equals_plain_forward(head_and_batch):
    model, head, ids, feats, mask = head_and_batch
    full = torch.ones(7, dtype=torch.bool)
    seqs = Sequences(ids=[ids[0]], feats=[feats[0]], mask=[full])
    acc = unroll_accuracy(head, seqs, 1, 1)[0]
    pred = head(feats[:1, :-1], ids[:1, 1:], torch.arange(6)[None])[0]
    want = (model.lm_head(pred).argmax(-1) == model.lm_head(feats[0, 1:]).argmax(-1)).float().mean()
    assert abs(acc - float(want)) < 1e-6


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_unrolled_loss_step2_is_the_drafting_chain(head_and_batch, fraction):
    """Training-time test: step 2 at anchor j is what drafting computes (the real prefix up to j,
    then the head's own f_hat_{j+1} with t_{j+2}), against f_{j+2}, weighted by the decay; with a
    fraction < 1, only the sampled anchors' chains count."""
    model, head, ids, feats, mask = head_and_batch
    l1, _ = eagle_loss(head, ids, feats, mask, 0.0, 0.1)
    l2, info = eagle_loss(head, ids, feats, mask, 0.0, 0.1, torch.Generator().manual_seed(3), unroll=2,
                          unroll_decay=0.5, unroll_fraction=fraction)
    chosen = set(unroll_anchors(6, fraction, torch.Generator().manual_seed(3)).tolist())
    assert len(chosen) == (6 if fraction == 1.0 else 3)
    regs, ces = [], []
    for b in range(2):
        for j in range(5):  # anchors with a step-2 target f_{j+2} inside the sequence
            if not mask[b, j + 2] or j not in chosen:
                continue
            pos = torch.arange(j + 1)[None]
            f1 = head(feats[b:b + 1, :j + 1], ids[b:b + 1, 1:j + 2], pos)[0, -1]
            x = torch.cat([feats[b, :j + 1], f1[None]])[None]
            f2 = head(x, ids[b:b + 1, 1:j + 3], torch.arange(j + 2)[None])[0, -1]
            regs.append(F.smooth_l1_loss(f2, feats[b, j + 2]))
            p = model.lm_head(feats[b, j + 2]).softmax(-1)
            ces.append(-(p * model.lm_head(f2).log_softmax(-1)).sum())
    want = 0.5 * (torch.stack(regs).mean() + 0.1 * torch.stack(ces).mean())
    torch.testing.assert_close(l2 - l1, want)
    assert "acc2" in info
    l2.backward()  # gradients flow through both steps (no in-place cache writes)
    assert head.fc.weight.grad is not None


def test_draft_vocabulary_keeps_frequent_and_eos():
    counts = torch.zeros(50, dtype=torch.long)
    counts[10:20] = torch.arange(10, 20)
    d2t = draft_vocabulary(counts, 5, always=[1])
    assert d2t.tolist() == [1, 16, 17, 18, 19]
    assert draft_vocabulary(counts, 0, [1]) is None
    # refreshing an old vocabulary: the data's tokens by frequency, then the old one's lowest ids
    want = [1, 3, 5, *range(10, 20), 30]
    assert draft_vocabulary(counts, 14, always=[1], fill=[40, 3, 30, 17, 5]).tolist() == want
    small = draft_vocabulary(counts, 14, always=[1], fill=[3]).tolist()  # too small a fill: still full size
    assert len(set(small)) == 14 and {1, 3, *range(10, 20)} <= set(small)


def test_sharegpt_parsing_of_truncated_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},'
                 ' {"conversations": [{"from": "human", "va')
    recs = list(stream_json_array(p))
    assert len(recs) == 1
    assert to_messages(recs[0]["conversations"]) == [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "yo"}]
    assert to_messages([{"from": "gpt", "value": "x"}]) == []


def test_render_masks_assistant_tokens(tiny_features):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_features / "model")
    msgs = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8"}]
    ids, mask = render(msgs, tok, 100)
    assert [i for i, m in zip(ids, mask) if m] == [7, 8, 3]  # the reply and its end-of-turn token
    # a reply cut at a token budget (regenerate) keeps no end-of-turn label and ends the conversation
    cut = to_messages([{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7 w8", "truncated": True},
                       {"from": "human", "value": "w9"}, {"from": "gpt", "value": "w10"}])
    assert cut == msgs[:1] + [{**msgs[1], "truncated": True}]
    ids2, mask2 = render(cut, tok, 100)
    assert ids2 == ids[: len(ids2)] and [i for i, m in zip(ids2, mask2) if m] == [7, 8]


def test_extract_resumes_and_features_match_the_model(tiny_features):
    from transformers import AutoModelForCausalLM

    root = tiny_features
    shards = sorted((root / "feats" / "train").glob("*.safetensors"))
    t = read_shard(shards[0])
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    a, b = t["offsets"][:2].tolist()
    with torch.no_grad():
        h = model.model(t["input_ids"][a:b].long()[None]).last_hidden_state[0]
    torch.testing.assert_close(t["features"][a:b].float(), h, atol=2e-2, rtol=1e-2)  # fp16 storage
    # resume: delete one shard, re-run, get the same file back
    before = load_file(str(shards[1]))
    shards[1].unlink()
    extract(ExtractConfig(model=str(root / "model"), out_dir=str(root / "feats"), data=str(root / "convs.jsonl"),
                          max_len=64, max_tokens=10_000, heldout=4, conversations_per_shard=8))
    after = load_file(str(shards[1]))
    assert torch.equal(before["input_ids"], after["input_ids"])


def test_resume_equals_uninterrupted(tiny_features, tmp_path):
    root = tiny_features
    common = dict(features=str(root / "feats"), model=str(root / "model"), epochs=2, batch_tokens=128,
                  draft_vocab=0, eval_conversations=2, save_every=1, warmup_steps=2, lr=1e-3)
    full = train(TrainConfig(out=str(tmp_path / "a"), max_steps=5, **common))
    train(TrainConfig(out=str(tmp_path / "b"), max_steps=3, **common))  # "interrupted" after step 3
    ck = json.loads((tmp_path / "b" / (tmp_path / "b" / "latest").read_text().strip() / "trainer_state.json").read_text())
    assert ck["step"] == 3
    resumed = train(TrainConfig(out=str(tmp_path / "b"), max_steps=5, **common))
    assert resumed["step"] == full["step"] == 5
    assert [r["loss"] for r in resumed["log"]] == [r["loss"] for r in full["log"]]
    a = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "a" / "curves.png").is_file() and (tmp_path / "a" / "train_log.json").is_file()


@pytest.mark.parametrize("arch", ["hybrid", "eagle3"])
def test_bfloat16_autocast_trains_the_same_head_within_its_precision(tiny_features, tmp_path, arch):
    """--dtype bfloat16 runs the step's matrix products in bf16 and keeps fp32 weights: the first
    loss is the fp32 one to within bf16 rounding, and the trained weights stay fp32."""
    import shutil

    feats = tiny_features / "feats"
    if arch == "eagle3":  # its three fused layers, of a 2-layer target
        feats = tmp_path / "feats"
        shutil.copytree(tiny_features / "feats", feats)
        extract(ExtractConfig(model=str(tiny_features / "model"), out_dir=str(feats), aux_layers="1,1,2", aux_only=True))
    common = dict(features=str(feats), model=str(tiny_features / "model"), epochs=1, batch_tokens=128, draft_vocab=0,
                  eval_conversations=1, max_steps=2, arch=arch, aux_layers="1,1,2" if arch == "eagle3" else "")
    fp32 = train(TrainConfig(out=str(tmp_path / "a"), **common))
    bf16 = train(TrainConfig(out=str(tmp_path / "b"), dtype="bfloat16", **common))
    a, b = fp32["log"][0]["loss"], bf16["log"][0]["loss"]
    assert a != b and abs(a - b) < 0.02 * abs(a)
    assert all(t.dtype == torch.float32 for t in load_file(str(tmp_path / "b" / "head" / "model.safetensors")).values()
               if t.is_floating_point())
    with pytest.raises(EaglespecError, match="dtype must be"):
        TrainConfig(features="f", out="o", dtype="float16").validate()


def test_a_damaged_checkpoint_falls_back_to_the_one_before_and_the_schedule_cannot_change(tiny_features, tmp_path):
    """The checkpoint before the newest is kept; a damaged newest one (here its state cut short) is
    passed over for it, with a warning; resuming with another --epochs is refused in one line."""
    root = tiny_features
    common = dict(features=str(root / "feats"), model=str(root / "model"), epochs=2, batch_tokens=128,
                  draft_vocab=0, eval_conversations=2, save_every=1, warmup_steps=2, lr=1e-3)
    out = tmp_path / "run"
    train(TrainConfig(out=str(out), max_steps=3, **common))
    kept = sorted(p.name for p in out.glob("ckpt-*"))
    assert kept == ["ckpt-0000002", "ckpt-0000003"] and (out / "latest").read_text().strip() == kept[-1]
    state = out / kept[-1] / "trainer_state.json"
    state.write_text(state.read_text()[:20])
    with pytest.warns(UserWarning, match="damaged; resuming from"):
        resumed = train(TrainConfig(out=str(out), max_steps=4, **common))
    assert resumed["step"] == 4
    with pytest.raises(EaglespecError, match="trained with --epochs 2"):
        train(TrainConfig(out=str(out), max_steps=5, **{**common, "epochs": 3}))


def test_init_starts_from_a_trained_head(tiny_features, tmp_path):
    root = tiny_features
    common = dict(features=str(root / "feats"), model=str(root / "model"), epochs=1, batch_tokens=128,
                  draft_vocab=0, eval_conversations=2, save_every=50, warmup_steps=2)
    train(TrainConfig(out=str(tmp_path / "a"), max_steps=2, lr=1e-3, **common))
    trained = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    # a vanishing lr: the continued head must still be the trained one, not a fresh random init
    st = train(TrainConfig(out=str(tmp_path / "b"), max_steps=1, lr=1e-12, init=str(tmp_path / "a" / "head"), **common))
    continued = load_file(str(tmp_path / "b" / "head" / "model.safetensors"))
    assert st["step"] == 1 and trained.keys() == continued.keys()
    assert all(torch.allclose(trained[k], continued[k], atol=1e-6) for k in trained)
    # the --init head is evaluated before training (step 0): the baseline on this run's held-out set
    a, b = json.loads((tmp_path / "a" / "train_log.json").read_text()), st["evals"]
    assert [e["step"] for e in b] == [0, 1] and [e["step"] for e in a["evals"]] == [2]
    assert b[0]["unroll_acc"] == pytest.approx(a["evals"][-1]["unroll_acc"])
    meta = json.loads((tmp_path / "b" / "head" / "training.json").read_text())
    assert "metadata" not in json.loads((tmp_path / "b" / "head" / "config.json").read_text())  # configuration only
    assert [h["steps"] for h in meta["history"]] == [2]  # the continued head's run is kept


def test_training_history_is_flat_oldest_first_and_unfolds_legacy_nesting():
    """A head continued from a continued head lists every run once, oldest first; the nested
    `init_metadata` form of older heads unfolds into the same list."""
    from eaglespec.train.trainer import training_history
    legacy = {"steps": 3, "init_metadata": {"steps": 2, "init_metadata": {"steps": 1}}}
    flat = {"steps": 3, "history": [{"steps": 1}, {"steps": 2}]}
    assert training_history(legacy) == training_history(flat) == [{"steps": 1}, {"steps": 2}, {"steps": 3}]
    assert training_history({}) == []


def test_revocab_refreshes_the_init_heads_draft_vocabulary(tiny_features, tmp_path):
    """`train --init H --revocab`: H's draft vocabulary, same size (or --draft-vocab's), rebuilt from
    this run's data (its most frequent assistant tokens, then H's own lowest ids; `draft_vocabulary`'s
    test covers the fill); without --revocab H's is kept, and asking for another size is an error."""
    from eaglespec.cli import _config_from, build_parser
    from eaglespec.spec.head import EagleDraftHead
    from eaglespec.models import load_target
    from eaglespec.train.extract import read_shard, shard_files

    root = tiny_features
    common = dict(features=str(root / "feats"), model=str(root / "model"), epochs=1, batch_tokens=128,
                  eval_conversations=2, save_every=50, warmup_steps=2, max_steps=1, lr=1e-12)
    model, _ = load_target(str(root / "model"))
    head = EagleDraftHead(model.config, draft_vocab=torch.arange(32, 128)).bind(model)
    head.save_pretrained(tmp_path / "h")
    args = build_parser().parse_args(["train", "--features", common["features"], "--out", str(tmp_path / "b"),
                                      "--init", str(tmp_path / "h"), "--revocab"])
    assert _config_from(args, _TrainConfig).revocab
    train(TrainConfig(out=str(tmp_path / "a"), init=str(tmp_path / "h"), **common))
    train(TrainConfig(out=str(tmp_path / "b"), init=str(tmp_path / "h"), revocab=True, **common))
    kept = EagleDraftHead.from_pretrained(tmp_path / "a" / "head", model).d2t.tolist()
    new = EagleDraftHead.from_pretrained(tmp_path / "b" / "head", model).d2t.tolist()
    assert kept == list(range(32, 128))
    counts = sum(read_shard(p)["token_counts"] for p in shard_files(root / "feats" / "train"))
    eos = model.config.eos_token_id
    seen = set(torch.nonzero(counts).flatten().tolist())
    assert len(new) == 96 and eos in new and 32 < len(seen) < 95 and seen <= set(new)  # all the data's tokens
    rest = sorted(set(new) - seen - {eos})  # then H's lowest ids
    assert rest == sorted(set(range(32, 128)) - seen - {eos})[:len(rest)]
    # nothing to rebuild: no --init, or an --init head over the full vocabulary
    with pytest.raises(EaglespecError, match="give --init"):
        TrainConfig(features="f", out="o", revocab=True).validate()
    EagleDraftHead(model.config).bind(model).save_pretrained(tmp_path / "full")
    with pytest.raises(EaglespecError, match="full vocabulary"):
        train(TrainConfig(out=str(tmp_path / "c"), init=str(tmp_path / "full"), revocab=True, **common))
    # another size: --draft-vocab N with --revocab rebuilds at N (also for a full-vocabulary head);
    # without --revocab it is an error, not silently ignored
    n = len(seen) + 1  # room for every token of the data and EOS, and not H's 96
    train(TrainConfig(out=str(tmp_path / "d"), init=str(tmp_path / "h"), revocab=True, draft_vocab=n, **common))
    train(TrainConfig(out=str(tmp_path / "e"), init=str(tmp_path / "full"), revocab=True, draft_vocab=n, **common))
    for run in "de":
        d2t = EagleDraftHead.from_pretrained(tmp_path / run / "head", model).d2t.tolist()
        assert len(d2t) == n and eos in d2t and seen <= set(d2t)
    with pytest.raises(EaglespecError, match="add --revocab"):
        train(TrainConfig(out=str(tmp_path / "f"), init=str(tmp_path / "h"), draft_vocab=n, **common))
    with pytest.raises(EaglespecError, match="draft_vocab must be"):
        TrainConfig(features="f", out="o", draft_vocab=-2).validate()


def test_growing_a_head_keeps_its_predictions_and_trains_the_new_layer(tiny_features, tmp_path):
    """--layers 2 from a one-layer head: the grown head starts as exactly the old one (identity
    layer), its new layer then learns, and the result saves and loads as a two-layer head; a head
    written with the old one-layer key names ("layer.") still loads."""
    from eaglespec.spec.head import EagleDraftHead
    from eaglespec.models import load_target

    root = tiny_features
    common = dict(features=str(root / "feats"), model=str(root / "model"), epochs=1, batch_tokens=128,
                  draft_vocab=0, eval_conversations=2, save_every=50, warmup_steps=2, lr=1e-3)
    train(TrainConfig(out=str(tmp_path / "a"), max_steps=2, **common))
    model, _ = load_target(str(root / "model"))
    one = EagleDraftHead.from_pretrained(tmp_path / "a" / "head", model)
    f = torch.randn(1, 7, model.config.hidden_size)
    tok, pos = torch.randint(0, 100, (1, 7)), torch.arange(7)[None]
    with torch.no_grad():
        before = one(f, tok, pos)
        torch.testing.assert_close(one.grow(2)(f, tok, pos), before, atol=0, rtol=0)
    train(TrainConfig(out=str(tmp_path / "b"), max_steps=3, init=str(tmp_path / "a" / "head"), layers=2, **common))
    two = EagleDraftHead.from_pretrained(tmp_path / "b" / "head", model)
    assert two.num_layers == 2 and float(two.layers[1].self_attn.o_proj.weight.detach().abs().max()) > 0
    with torch.no_grad():
        assert not torch.allclose(two(f, tok, pos), before, atol=1e-4)
    # the old key names
    state = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    old = tmp_path / "old"
    old.mkdir()
    save_file({("layer." + k[9:] if k.startswith("layers.0.") else k): v for k, v in state.items()},
              str(old / "model.safetensors"))
    (old / "config.json").write_text((tmp_path / "a" / "head" / "config.json").read_text())
    with torch.no_grad():
        torch.testing.assert_close(EagleDraftHead.from_pretrained(old, model)(f, tok, pos), before)
    with pytest.raises(EaglespecError, match="shrink"):
        two.grow(1)


def test_corrupt_shard_names_the_file(tiny_features, tmp_path):
    import shutil

    feats = tmp_path / "feats"
    shutil.copytree(tiny_features / "feats", feats)
    shard = sorted((feats / "train").glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=shard.name):
        train(TrainConfig(features=str(feats), out=str(tmp_path / "o"), model=str(tiny_features / "model"),
                          max_steps=1))


def test_a_shard_cut_short_in_its_data_names_the_file(tiny_features, tmp_path):
    """The header intact, the tensors cut: the memory-mapped reader refuses it at load, not mid-epoch."""
    import shutil

    from eaglespec.train.trainer import load_split

    feats = tmp_path / "feats"
    shutil.copytree(tiny_features / "feats", feats)
    shard = sorted((feats / "train").glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 64])
    with pytest.raises(CheckpointError, match=shard.name):
        load_split(feats / "train")


def test_features_are_read_from_disk_a_conversation_at_a_time(tiny_features, tmp_path):
    """load_split keeps ids and masks in memory and reads each conversation's features (and aux
    layers after them) from the shard when indexed: the same values `read_shard` / `read_aux` load."""
    import shutil

    from eaglespec.train.extract import read_aux
    from eaglespec.train.trainer import FeatureRows, load_split

    feats = tmp_path / "feats"
    shutil.copytree(tiny_features / "feats", feats)
    extract(ExtractConfig(model=str(tiny_features / "model"), out_dir=str(feats), aux_layers="1,2", aux_only=True))
    seqs = load_split(feats / "train", aux_layers=[1, 2])
    assert isinstance(seqs.feats, FeatureRows) and seqs.width == 3 * 64
    i = 0
    for shard in sorted((feats / "train").glob("shard_*[0-9].safetensors")):
        t = read_shard(shard)
        aux = read_aux(shard, [1, 2], t["features"].shape[0])
        for a, b in zip(t["offsets"].tolist(), t["offsets"][1:].tolist()):
            want = torch.cat([t["features"][a:b, None], aux[a:b]], 1).flatten(1)
            assert torch.equal(seqs.feats[i], want) and torch.equal(seqs.ids[i], t["input_ids"][a:b].long())
            i += 1
    assert i == len(seqs.feats) == len(seqs.ids) > 1


def test_the_defaults_extract_eagle3s_layers_and_train_an_eagle3_head(tiny_features, tmp_path):
    """Out of the box, extract writes EAGLE-3's low, mid and high layers (2, L // 2, L - 3) beside
    the features of a target deep enough, and train trains an EAGLE-3 head on them; a shallow
    target gets no aux file from "auto", and "none" asks for none."""
    import shutil

    from eaglespec.train.extract import aux_layers_for, aux_path, shard_files

    assert aux_layers_for("auto", 24) == [2, 12, 21] and aux_layers_for("auto", 30) == [2, 15, 27]
    assert aux_layers_for("auto", 2) == [] and aux_layers_for("none", 24) == [] and aux_layers_for("3,5", 8) == [3, 5]
    assert aux_layers_for("auto", 6) == [2, 3, 3] and aux_layers_for("auto", 4) == []  # what a head of it defaults to
    assert EagleDraftHead(tiny_target("llama", layers=6, device="cpu").config, arch="eagle3").aux_layers == [2, 3, 3]
    with pytest.raises(ValueError, match="too shallow"):
        EagleDraftHead(tiny_target("llama", layers=4, device="cpu").config, arch="eagle3")
    with pytest.raises(EaglespecError, match="too shallow.*--aux-layers"):  # the CLI's one line, before any data is read
        train(_TrainConfig(features=str(tiny_features / "feats"), out=str(tmp_path / "shallow"),
                           model=str(tiny_features / "model"), arch="eagle3"))
    assert _TrainConfig(features="f", out="o").arch == "eagle3"
    root = tmp_path / "deep"
    shutil.copytree(tiny_features / "model", root / "model")
    tiny_target("llama", layers=8, device="cpu").save_pretrained(root / "model")
    rep = extract(ExtractConfig(model=str(root / "model"), out_dir=str(root / "feats"),
                                data=str(tiny_features / "convs.jsonl"), max_len=64, max_tokens=2_000, heldout=4))
    assert rep["aux_layers"] == [2, 4, 5]
    assert all(aux_path(s).is_file() for s in shard_files(root / "feats", "*/shard_*.safetensors"))
    st = train(_TrainConfig(features=str(root / "feats"), out=str(tmp_path / "run"), model=str(root / "model"),
                            max_steps=2, batch_tokens=128, eval_conversations=1, draft_vocab=0))
    head = EagleDraftHead.from_pretrained(tmp_path / "run" / "head", tiny_target("llama", layers=8, device="cpu"))
    assert st["step"] == 2 and head.arch == "eagle3" and head.aux_layers == [2, 4, 5]
    none = extract(ExtractConfig(model=str(root / "model"), out_dir=str(tmp_path / "plain"), aux_layers="none",
                                 data=str(tiny_features / "convs.jsonl"), max_len=64, max_tokens=500, heldout=4))
    assert "aux_layers" not in none and not list((tmp_path / "plain").glob("*/*.aux.safetensors"))


def test_an_eagle3_head_of_a_qwen2_target_is_a_llama_layer_without_biases(tiny_features, tmp_path):
    """EAGLE-3's and official EAGLE's heads are Llama layers whatever the target (what vLLM, SGLang
    and llama.cpp read): trained for a Qwen2 target, the head has no attention biases, exports none,
    and decodes to the target's greedy output; GGUF export refuses a head whose layer has biases.
    `intermediate_size` narrows a new head's MLP (the exported layer config says so), not an --init's."""
    import shutil

    from safetensors.torch import load_file as read

    from eaglespec.interop import export_gguf
    from eaglespec.models import Engine, load_target
    from eaglespec.spec.formats import export_head

    root = tmp_path / "qwen"
    shutil.copytree(tiny_features / "model", root / "model")
    for f in (root / "model").glob("*.json"):
        if f.name in ("config.json", "generation_config.json"):
            f.unlink()
    tiny_target("qwen2", layers=8, device="cpu").save_pretrained(root / "model")
    extract(ExtractConfig(model=str(root / "model"), out_dir=str(root / "feats"),
                          data=str(tiny_features / "convs.jsonl"), max_len=64, max_tokens=2_000, heldout=4))
    train(_TrainConfig(features=str(root / "feats"), out=str(tmp_path / "run"), model=str(root / "model"),
                       max_steps=2, batch_tokens=128, eval_conversations=1, draft_vocab=0, intermediate_size=48))
    target, _ = load_target(str(root / "model"))
    head = EagleDraftHead.from_pretrained(tmp_path / "run" / "head", target)
    assert head.arch == "eagle3" and head.model_type == "qwen2"
    assert head.layer_config.model_type == "llama" and not head.layer_config.attention_bias
    assert head.layer_config.intermediate_size == 48 and target.config.intermediate_size == 128
    exported = export_head(head, "speculators", tmp_path / "spec", target.config)
    weights = read(str(exported / "model.safetensors"))
    assert not [k for k in weights if k.endswith("bias")] and weights["layers.0.mlp.up_proj.weight"].shape[0] == 48
    assert json.loads((exported / "config.json").read_text())["transformer_layer_config"]["intermediate_size"] == 48
    with pytest.raises(EaglespecError, match="its own MLP width"):
        _TrainConfig(features="f", out="o", init=str(tmp_path / "run" / "head"), intermediate_size=48).validate()
    prompt = [2, 17, 40, 9, 3, 4]
    x = torch.tensor([prompt])
    want = target.generate(x, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0,
                           attention_mask=torch.ones_like(x))[0, len(prompt):].tolist()
    assert Engine(target, head, tree="paper").generate(prompt, 20).token_ids == want
    biased = EagleDraftHead(target.config, arch="eagle3").bind(target)
    with pytest.raises(EaglespecError, match="without biases"):
        export_gguf(biased, root / "model", tmp_path / "gguf")


def test_interrupted_extract_leaves_a_true_manifest(tiny_features, tmp_path, monkeypatch):
    """Killed mid-split, the manifest still lists exactly the shards on disk (and a rerun resumes)."""
    import eaglespec.train.extract as ex

    real, calls = ex._shard, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # heldout shard, first train shard, then the kill
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ex, "_shard", interrupted)
    root = tiny_features
    cfg = ExtractConfig(model=str(root / "model"), out_dir=str(tmp_path / "feats"), data=str(root / "convs.jsonl"),
                        max_len=64, max_tokens=10_000, heldout=4, conversations_per_shard=8)
    with pytest.raises(KeyboardInterrupt):
        extract(cfg)
    manifest = json.loads((tmp_path / "feats" / "manifest.json").read_text())
    on_disk = sorted(p.name for p in (tmp_path / "feats" / "train").glob("*.safetensors"))
    assert on_disk and [s["file"].split("/")[-1] for s in manifest["train"]["shards"]] == on_disk


def test_pooled_feature_folders(tiny_features, tmp_path):
    """--features a,b trains on both train splits; the held-out split is the first folder's."""
    from eaglespec.train.trainer import load_split

    d = tiny_features / "feats"
    one, two = load_split(d / "train"), load_split(d / "train", d / "train")
    assert len(two.ids) == 2 * len(one.ids) and torch.equal(two.token_counts, 2 * one.token_counts)
    st = train(TrainConfig(features=f"{d},{d}", out=str(tmp_path / "o"), model=str(tiny_features / "model"),
                           max_steps=1, draft_vocab=0, eval_conversations=1, batch_tokens=128))
    assert st["step"] == 1
    with pytest.raises(EaglespecError, match="no feature shards"):
        train(TrainConfig(features=f"{d},{tmp_path}", out=str(tmp_path / "p"), model=str(tiny_features / "model")))


def test_aux_layers_extract_and_train_a_fused_head(tiny_features, tmp_path, monkeypatch):
    """`extract --aux-only --aux-layers` writes each shard's aux file (the model's hidden states at
    those layers, resumable), and `extract --aux-layers` the same files from its own forwards;
    `train --init H --aux-layers` trains a head that fuses them; a folder
    without them, or with other layers, gives an error naming the file."""
    import shutil

    from transformers import AutoModelForCausalLM

    from eaglespec.spec.head import EagleDraftHead
    from eaglespec.models import load_target
    from eaglespec.train.extract import aux_path

    root = tiny_features
    feats = tmp_path / "feats"
    shutil.copytree(root / "feats", feats)
    cfg = ExtractConfig(model=str(root / "model"), out_dir=str(feats), aux_layers="1,2", aux_only=True)
    rep = extract(cfg)
    shards = sorted((feats / "train").glob("shard_*[0-9].safetensors"))
    assert rep["new_tokens"] > 0 and all(aux_path(s).is_file() for s in shards)
    assert extract(cfg)["new_tokens"] == 0  # resumed: nothing left to do
    with pytest.raises(CheckpointError, match="holds layers"):
        extract(ExtractConfig(model=str(root / "model"), out_dir=str(feats), aux_layers="2", aux_only=True))
    with pytest.raises(EaglespecError, match="must lie in"):
        extract(ExtractConfig(model=str(root / "model"), out_dir=str(feats), aux_layers="1,9", aux_only=True))
    t, aux = read_shard(shards[0]), load_file(str(aux_path(shards[0])))
    a, b = t["offsets"][:2].tolist()
    model = AutoModelForCausalLM.from_pretrained(root / "model")
    with torch.no_grad():
        hs = model.model(t["input_ids"][a:b].long()[None], output_hidden_states=True).hidden_states
    assert aux["layers"].tolist() == [1, 2]
    torch.testing.assert_close(aux["aux"][a:b].float(), torch.stack([hs[1][0], hs[2][0]], 1), atol=2e-2, rtol=1e-2)

    # extract with --aux-layers takes them from the forward that computes the features: one pass
    import eaglespec.train.extract as ex

    features_for, passed = ex.features_for, []

    def counted(model, batch, layers=None):
        passed.append(sum(map(len, batch)))
        return features_for(model, batch, layers)

    monkeypatch.setattr(ex, "features_for", counted)
    one = tmp_path / "one"
    rep = extract(ExtractConfig(model=str(root / "model"), out_dir=str(one), data=str(root / "convs.jsonl"),
                                max_len=64, max_tokens=10_000, heldout=4, conversations_per_shard=8, aux_layers="1,2"))
    assert sum(passed) == rep["train"]["tokens"] + rep["heldout"]["tokens"]
    for s in shards:
        mine = one / "train" / s.name
        assert torch.equal(read_shard(mine)["features"], read_shard(root / "feats" / "train" / s.name)["features"])
        torch.testing.assert_close(load_file(str(aux_path(mine)))["aux"], load_file(str(aux_path(s)))["aux"])

    common = dict(model=str(root / "model"), epochs=1, batch_tokens=128, draft_vocab=0, eval_conversations=2,
                  save_every=50, warmup_steps=2, lr=1e-3)
    train(TrainConfig(features=str(feats), out=str(tmp_path / "a"), max_steps=2, **common))
    st = train(TrainConfig(features=str(feats), out=str(tmp_path / "b"), max_steps=3, aux_layers="1,2",
                           init=str(tmp_path / "a" / "head"), **common))
    target, _ = load_target(str(root / "model"))
    fused = EagleDraftHead.from_pretrained(tmp_path / "b" / "head", target)
    assert st["step"] == 3 and fused.aux_layers == [1, 2] and float(fused.fuse.weight.detach().abs().max()) > 0
    with pytest.raises(CheckpointError, match="holds layers"):
        train(TrainConfig(features=str(feats), out=str(tmp_path / "c"), max_steps=1, aux_layers="2", **common))
    with pytest.raises(CheckpointError, match="missing; run"):
        train(TrainConfig(features=str(root / "feats"), out=str(tmp_path / "d"), max_steps=1,
                          init=str(tmp_path / "b" / "head"), **common))
    with pytest.raises(EaglespecError, match="comma-separated"):
        train(TrainConfig(features=str(feats), out=str(tmp_path / "e"), aux_layers="x", **common))


def prompt_ids(tok, record: dict) -> list[int]:
    """A regenerated record's prompt: its first user turn in the chat template."""
    prompt = [{"role": "user", "content": record["conversations"][0]["value"]}]
    return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)


def sampled_answer(eng, tok, record: dict, seed: int, max_new_tokens: int = 6) -> str:
    """The engine's T = 1 sample (vanilla, this seed) of a regenerated record's first user turn; EOS
    (id 1) ends it, and special tokens (EOS, w0) are not part of its text."""
    from eaglespec.spec.verify import SamplingParams

    out = eng.generate_batch([prompt_ids(tok, record)], max_new_tokens, SamplingParams(temperature=1.0),
                             method="vanilla", seed=seed, eos_token_ids=[1])[0]
    return tok.decode(out.token_ids, skip_special_tokens=True)  # as regenerate writes answers


def greedy_answer(eng, tok, record: dict, max_new_tokens: int = 6) -> tuple[str, str]:
    """The engine's greedy answer to a regenerated record's first user turn: (text, finish reason);
    EOS (id 1) ends the answer, and special tokens (EOS, w0) are not part of its text."""
    out = eng.generate(prompt_ids(tok, record), max_new_tokens, method="vanilla", eos_token_ids=[1])
    return tok.decode(out.token_ids, skip_special_tokens=True), out.finish_reason


def regenerate_shards(feats, aux_layers: list[int] | None = None) -> dict[int, tuple]:
    """Every conversation in a `regenerate --features-out` folder, once each:
    {conv_id: (split, input_ids, loss_mask, features, aux features or None)}."""
    from eaglespec.train.extract import read_aux

    got = {}
    for path in sorted(feats.glob("*/shard_*.safetensors")):
        if path.name.endswith(".aux.safetensors"):
            continue
        t = read_shard(path)
        off = t["offsets"].tolist()
        aux = read_aux(path, aux_layers, off[-1]) if aux_layers else None
        for c, a, b in zip(t["conv_ids"].tolist(), off, off[1:]):
            assert c not in got, f"conversation {c} twice"
            got[c] = (path.parent.name, t["input_ids"][a:b].tolist(), t["loss_mask"][a:b].tolist(),
                      t["features"][a:b].float(), None if aux is None else aux[a:b].float())
    return got


def assert_shard_holds_the_records_answer(tok, record: dict, ids: list[int], mask: list[int]) -> None:
    """The loss-masked ids of a regenerate shard are the JSONL answer as generated (its last token
    aside; the text, like regenerate's, without special tokens)."""
    answer = [t for t, m in zip(ids, mask) if m]
    assert record["conversations"][1]["value"].startswith(tok.decode(answer, skip_special_tokens=True))


def test_regenerate_writes_the_targets_greedy_answers_and_resumes(tiny_features, tmp_path):
    from transformers import AutoTokenizer

    from eaglespec import Engine
    from eaglespec.models import load_target
    from eaglespec.train.data import load_conversations
    from eaglespec.train.regenerate import RegenerateConfig, regenerate

    root = tiny_features
    out = tmp_path / "self.jsonl"
    cfg = RegenerateConfig(model=str(root / "model"), out=str(out), data=str(root / "convs.jsonl"),
                           max_new_tokens=6, max_conversations=7, batch_size=3, heldout=4)
    rep = regenerate(cfg)
    assert rep["answered"] == 7 and rep["already_done"] == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == list(range(7)) and {r["temperature"] for r in recs} == {0.0}
    model, _ = load_target(str(root / "model"))
    tok = AutoTokenizer.from_pretrained(root / "model")
    eng = Engine(model, None)
    for r in recs[:3]:  # the answer is the target's own greedy continuation of the first user turn
        text, reason = greedy_answer(eng, tok, r)
        assert r["conversations"][1]["value"] == text
        assert r["conversations"][1]["truncated"] == (reason == "length")
    # the output is readable training data
    assert len(load_conversations(str(out))) == sum(1 for r in recs if r["conversations"][1]["value"].strip())
    # interrupted mid-line: the cut record is dropped and answered again, nothing twice
    text = out.read_text()
    out.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
    rep = regenerate(cfg)
    assert rep["answered"] == 1 and rep["already_done"] == 6
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in again) == list(range(7)) and again[-1] == recs[-1]
    # a slice: ids keep their place in the whole split, so files of several slices concatenate
    part = tmp_path / "part.jsonl"
    regenerate(replace(cfg, out=str(part), first_conversation=5))
    assert [json.loads(x) for x in part.read_text().splitlines()] == [r for r in recs if r["id"] >= 5]
    with pytest.raises(EaglespecError, match="first-conversation"):
        regenerate(replace(cfg, out=str(part), first_conversation=-1))
    # a length window: the prompts one run's --max-prompt-len skipped are another run's --min-prompt-len
    lens = {r["id"]: len(prompt_ids(tok, r)) for r in recs}
    cut = sorted(lens.values())[len(lens) // 2]
    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    regenerate(replace(cfg, out=str(short), max_prompt_len=cut - 1))
    regenerate(replace(cfg, out=str(long), min_prompt_len=cut))
    ids = [{json.loads(x)["id"] for x in f.read_text().splitlines()} for f in (short, long)]
    assert ids[0] == {i for i, n in lens.items() if n < cut} and ids[1] == {i for i, n in lens.items() if n >= cut}
    assert ids[0] and ids[1]


def test_regenerate_features_equal_an_extraction_of_the_same_tokens_and_survive_interruption(tiny_features, tmp_path):
    """--features-out: each conversation is prompt + answer (its last token dropped: never fed) with
    extract's features of exactly those ids, and with --aux-layers extract's aux features of them; a
    batch cut between its shard and its JSONL lines is redone without a duplicate, its aux cut alike."""
    from transformers import AutoTokenizer

    from eaglespec.models import load_target
    from eaglespec.train.extract import features_for
    from eaglespec.train.regenerate import RegenerateConfig, regenerate
    from eaglespec.train.trainer import load_split

    root = tiny_features
    out, feats = tmp_path / "self.jsonl", tmp_path / "feats"
    cfg = RegenerateConfig(model=str(root / "model"), out=str(out), data=str(root / "convs.jsonl"),
                           max_new_tokens=6, max_conversations=8, batch_size=3, heldout=4,
                           features_out=str(feats), heldout_every=3, aux_layers="1,2")
    regenerate(cfg)
    recs = {json.loads(x)["id"]: json.loads(x) for x in out.read_text().splitlines()}
    model, _ = load_target(str(root / "model"))

    got = regenerate_shards(feats, [1, 2])
    assert sorted(got) == sorted(recs) == list(range(8))
    for c, (split_name, ids, mask, f, aux) in got.items():
        assert split_name == ("heldout" if c % 3 == 0 else "train")
        n_answer = sum(mask)
        assert n_answer >= 1 and mask == [0] * (len(ids) - n_answer) + [1] * n_answer
        torch.testing.assert_close(f, features_for(model, [ids])[0], atol=2e-3, rtol=2e-3)  # fp16 storage
        torch.testing.assert_close(aux, features_for(model, [ids], [1, 2])[0][:, 1:], atol=2e-3, rtol=2e-3)
    # the answer in the shard is the JSONL's answer, as generated (its last token aside)
    tok = AutoTokenizer.from_pretrained(root / "model")
    for c, (_, ids, mask, _, _) in got.items():
        assert_shard_holds_the_records_answer(tok, recs[c], ids, mask)
    assert len(load_split(feats / "train").ids) + len(load_split(feats / "heldout").ids) == 8
    # interrupted after a batch's shards but before all its JSONL lines: the last batch (2 rows) and
    # one row of the batch before lose their lines, so one shard keeps part of its conversations
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:-3]) + "\n")
    rep = regenerate(cfg)
    assert rep["answered"] == 3
    again = regenerate_shards(feats, [1, 2])
    assert sorted(again) == list(range(8))
    for c in got:
        assert again[c][:3] == got[c][:3]
        # redone in another batch (other padding): the same values to fp16 storage
        torch.testing.assert_close(again[c][3], got[c][3], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(again[c][4], got[c][4], atol=2e-3, rtol=2e-3)
    with pytest.raises(EaglespecError, match="heldout-every"):
        regenerate(replace(cfg, heldout_every=0))
    with pytest.raises(EaglespecError, match="needs --features-out"):
        regenerate(replace(cfg, features_out=""))
    with pytest.raises(EaglespecError, match="aux layers must lie"):
        regenerate(replace(cfg, aux_layers="1,99"))


def test_regenerate_with_temperature_writes_the_targets_sampled_answers_and_their_features(tiny_features, tmp_path):
    """--temperature > 0: each answer is the engine's vanilla sample of its prompt with the seed
    `seed + id` (one prompt per batch here), not the greedy answer, and its shard holds those ids."""
    from transformers import AutoTokenizer

    from eaglespec import Engine
    from eaglespec.models import load_target
    from eaglespec.train.extract import features_for
    from eaglespec.train.regenerate import RegenerateConfig, regenerate

    root = tiny_features
    out, feats = tmp_path / "sampled.jsonl", tmp_path / "feats"
    cfg = RegenerateConfig(model=str(root / "model"), out=str(out), data=str(root / "convs.jsonl"), max_new_tokens=6,
                           max_conversations=6, batch_size=1, heldout=4, seed=7, temperature=1.0,
                           features_out=str(feats))
    regenerate(cfg)
    recs = {json.loads(x)["id"]: json.loads(x) for x in out.read_text().splitlines()}
    assert sorted(recs) == list(range(6)) and {r["temperature"] for r in recs.values()} == {1.0}
    model, _ = load_target(str(root / "model"))
    tok = AutoTokenizer.from_pretrained(root / "model")
    eng = Engine(model, None)
    differs = 0
    for i, r in recs.items():
        assert r["conversations"][1]["value"] == sampled_answer(eng, tok, r, seed=7 + i)
        differs += r["conversations"][1]["value"] != greedy_answer(eng, tok, r)[0]
    assert differs >= 3  # a random tiny model's samples part from its greedy answers
    got = regenerate_shards(feats)
    assert sorted(got) == list(range(6))
    for c, (_, ids, mask, f, _) in got.items():
        assert_shard_holds_the_records_answer(tok, recs[c], ids, mask)
        torch.testing.assert_close(f, features_for(model, [ids])[0], atol=2e-3, rtol=2e-3)
    # --sample-round 1: the same prompts (the split is seed's), a new random stream
    again = tmp_path / "round1.jsonl"
    regenerate(replace(cfg, out=str(again), features_out="", sample_round=1))
    recs1 = {json.loads(x)["id"]: json.loads(x) for x in again.read_text().splitlines()}
    assert sorted(recs1) == sorted(recs)
    assert {r["sample_round"] for r in recs.values()} == {0} and {r["sample_round"] for r in recs1.values()} == {1}
    for i, r in recs1.items():
        assert r["conversations"][0] == recs[i]["conversations"][0]
        assert r["conversations"][1]["value"] == sampled_answer(eng, tok, r, seed=7 + i + 1_000_003)
    assert sum(recs1[i]["conversations"][1] != recs[i]["conversations"][1] for i in recs) >= 3
    with pytest.raises(ValueError, match="temperature"):
        regenerate(replace(cfg, temperature=-1.0))


def test_regenerate_in_bf16_gives_the_bf16_targets_answers_and_near_fp32_features(tiny_features, tmp_path):
    """--dtype bfloat16: the answers are the bf16 model's own greedy decoding, and the stored features
    are an fp32 extraction of the same ids to within bf16 rounding (and no closer than fp16 storage
    alone would leave them: the bf16 path really ran)."""
    from transformers import AutoTokenizer

    from eaglespec import Engine
    from eaglespec.models import load_target
    from eaglespec.train.extract import features_for
    from eaglespec.train.regenerate import RegenerateConfig, regenerate

    root = tiny_features
    out, feats = tmp_path / "self.jsonl", tmp_path / "feats"
    cfg = RegenerateConfig(model=str(root / "model"), out=str(out), data=str(root / "convs.jsonl"),
                           max_new_tokens=6, max_conversations=6, batch_size=3, heldout=4,
                           features_out=str(feats), dtype="bfloat16")
    regenerate(cfg)
    recs = {json.loads(x)["id"]: json.loads(x) for x in out.read_text().splitlines()}
    tok = AutoTokenizer.from_pretrained(root / "model")
    bf16, _ = load_target(str(root / "model"), dtype=torch.bfloat16)
    eng = Engine(bf16, None)
    for r in list(recs.values())[:3]:
        assert r["conversations"][1]["value"] == greedy_answer(eng, tok, r)[0]
    fp32, _ = load_target(str(root / "model"))
    errs = []
    for path in sorted(feats.glob("*/shard_*.safetensors")):
        t = read_shard(path)
        off = t["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            ref = features_for(fp32, [t["input_ids"][a:b].tolist()])[0]
            errs.append(((t["features"][a:b].float() - ref).norm(dim=-1) / ref.norm(dim=-1)).mean())
    err = float(torch.stack(errs).mean())
    assert len(errs) == len(recs) and 1e-3 < err < 0.05, err
    with pytest.raises(EaglespecError, match="--dtype"):
        regenerate(replace(cfg, dtype="float16"))


def test_regenerate_answers_the_opening_turns_of_dropped_records(tiny_features, tmp_path):
    """Records the conversation filter drops still open with a usable user turn: `--prompts dropped`
    answers exactly those, numbered apart from the split's ids, and nothing the split holds."""
    from transformers import AutoTokenizer

    from eaglespec import Engine
    from eaglespec.models import load_target
    from eaglespec.train.data import dropped_first_turns, load_conversations
    from eaglespec.train.regenerate import DROPPED_ID0, RegenerateConfig, regenerate

    root = tiny_features
    recs = [{"conversations": [{"from": "human", "value": "w5 w6"}, {"from": "gpt", "value": "w7"}]},  # kept
            {"conversations": [{"from": "human", "value": "w8 w9"}, {"from": "human", "value": "w10"},
                               {"from": "gpt", "value": "w11"}]},  # two user turns in a row
            {"conversations": [{"from": "gpt", "value": "w12"}, {"from": "human", "value": "w13"}]},  # a later piece
            {"conversations": [{"from": "gpt", "value": "w18"}, {"from": "gpt", "value": "w19"}]},  # no user turn
            {"conversations": [{"from": "system", "value": "w14"}, {"from": "human", "value": "w15 w16"},
                               {"from": "gpt", "value": ""}]},  # an empty reply
            {"conversations": [{"from": "human", "value": "w17"}]}]  # never answered
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in recs))
    assert len(load_conversations(str(data))) == 1
    assert dropped_first_turns(str(data)) == [
        [{"role": "user", "content": "w8 w9"}],
        [{"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"}],
        [{"role": "system", "content": "w14"}, {"role": "user", "content": "w15 w16"}],
        [{"role": "user", "content": "w17"}]]
    out = tmp_path / "dropped.jsonl"
    cfg = RegenerateConfig(model=str(root / "model"), out=str(out), data=str(data), max_new_tokens=6,
                           batch_size=2, heldout=0, prompts="dropped")
    assert regenerate(cfg)["answered"] == 4
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == [DROPPED_ID0 + k for k in range(4)]
    assert [(t["from"], t["value"]) for t in got[DROPPED_ID0 + 1]["conversations"]][:2] == [("gpt", "w12"), ("human", "w13")]
    assert [t["value"] for t in got[DROPPED_ID0 + 2]["conversations"][:2]] == ["w14", "w15 w16"]
    model, _ = load_target(str(root / "model"))
    tok = AutoTokenizer.from_pretrained(root / "model")
    assert got[DROPPED_ID0]["conversations"][1]["value"] == greedy_answer(Engine(model, None), tok, got[DROPPED_ID0])[0]
    with pytest.raises(EaglespecError, match="--prompts"):
        regenerate(replace(cfg, prompts="later"))


def test_head_metadata_has_no_machine_paths():
    from pathlib import Path

    from eaglespec.train.trainer import _portable

    cfg = {"features": f"{Path.home()}/f/a,{Path.cwd()}/b", "out": "/tmp/x", "init": "", "lr": 1e-4}
    assert _portable(cfg) == {"features": "~/f/a,b", "out": "/tmp/x", "init": "", "lr": 1e-4}
    shipped = sorted((Path(__file__).parents[1] / "src/eaglespec/heads").glob("*/training.json"))
    assert len(shipped) >= 4
    for record in shipped:
        assert "/root/" not in record.read_text() and "/work/" not in record.read_text(), record


def fc_inputs(head: EagleDraftHead) -> list[torch.Tensor]:
    """What the head's FC reads, call by call: cat(feature half, embedding half)."""
    seen: list[torch.Tensor] = []
    head.fc.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    return seen


@pytest.mark.parametrize("mode", ["feature+shifted_token", "feature+unshifted_token", "feature", "token"])
def test_each_input_mode_trains_on_what_it_says(head_and_batch, mode):
    """Paper Fig. 8: the loss feeds EAGLE f_j with t_{j+1}; the ablations f_j with t_j, f_j alone,
    t_{j+1} alone. Checked on the inputs the head's FC sees, at the unrolled step too."""
    model, _, ids, feats, mask = head_and_batch
    torch.manual_seed(0)
    head = EagleDraftHead(model.config, input_mode=mode).bind(model)
    seen = fc_inputs(head)
    eagle_loss(head, ids, feats, mask, noise=0.0, ce_weight=0.1, unroll=2, unroll_fraction=1.0)
    H, emb = 64, model.get_input_embeddings()
    f_half, e_half = seen[0][..., :H], seen[0][..., H:]
    want_f = torch.zeros_like(feats[:, :-1]) if mode == "token" else feats[:, :-1]
    shifted = ids[:, 1:] if mode != "feature+unshifted_token" else ids[:, :-1]
    want_e = torch.zeros_like(f_half) if mode == "feature" else emb(shifted)
    torch.testing.assert_close(f_half, want_f)
    torch.testing.assert_close(e_half, want_e)
    # step 2 reads the head's own step-1 prediction with the next token along (t_{j+2}, or t_{j+1})
    step2 = ids[:, 2:] if mode != "feature+unshifted_token" else ids[:, 1:-1]
    if mode != "feature":
        torch.testing.assert_close(seen[1][:, :-1, H:], emb(step2))
    with pytest.raises(EaglespecError, match="input_mode"):
        TrainConfig(features="f", out="o", input_mode="features").validate()


def test_training_on_two_processes_ends_and_matches_one(tiny_features, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m eaglespec.cli train` (torchrun underneath; DDP over
    gloo on a CPU-only machine, where `--cpu` would start one process) with an odd number of batches, so
    that a plain split would give one process a step more and hang it at the last gradient
    all-reduce: the run ends, both processes take the same steps, and the head it trains reaches a
    held-out accuracy within 0.05 of one process's (each of its steps averages two batches, so the
    runs are not step for step alike)."""
    import subprocess
    import sys

    from eaglespec.train.trainer import epoch_batches, load_split

    root = tiny_features
    args = ["train", "--features", str(root / "feats"), "--model", str(root / "model"), "--epochs", "3",
            "--batch-tokens", "256", "--draft-vocab", "0", "--eval-conversations", "4", "--lr", "3e-3",
            "--warmup-steps", "2", "--save-every", "1000", "--arch", "hybrid"]
    lengths = [x.numel() for x in load_split(root / "feats" / "train").ids]
    assert sum(len(epoch_batches(lengths, 256, 0, e)) for e in range(3)) % 2 == 1
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one = subprocess.run([sys.executable, "-m", "eaglespec.cli", *args, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=env)
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "--main_process_port", "0", "-m", "eaglespec.cli", *args, "--out", str(tmp_path / "two")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    logs = {k: json.loads((tmp_path / k / "train_log.json").read_text()) for k in ("one", "two")}
    assert len(logs["two"]["log"]) == sum(len(epoch_batches(lengths, 256, 0, e)) for e in range(3)) // 2
    acc = {k: v["evals"][-1]["unroll_acc"][0] for k, v in logs.items()}
    assert abs(acc["one"] - acc["two"]) <= 0.05, acc


def test_regenerate_topics_split_the_prompts_into_code_and_the_rest(tiny_features, tmp_path):
    """`--topic code` answers the opening turns about programming, `--topic other` exactly the rest:
    two runs that pool without answering a prompt twice."""
    from eaglespec.train.data import is_code_prompt
    from eaglespec.train.regenerate import RegenerateConfig, regenerate

    texts = ["w5 w6", "```w7```", "def w8 return", "w9 class", "import w10 return", "w11"]
    assert [is_code_prompt([{"role": "user", "content": t}]) for t in texts] == [False, True, True, False, True, False]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "w3"}]})
                              for t in texts))
    cfg = RegenerateConfig(model=str(tiny_features / "model"), out="", data=str(data), max_new_tokens=3, batch_size=4,
                           heldout=0)
    got = {}
    for topic in ("code", "other", "all"):
        out = tmp_path / f"{topic}.jsonl"
        regenerate(replace(cfg, out=str(out), topic=topic))
        got[topic] = {r["conversations"][0]["value"] for r in map(json.loads, out.read_text().splitlines())}
    assert got["code"] == {t for t in texts[1:5] if t != "w9 class"} and got["other"] == {"w5 w6", "w9 class", "w11"}
    assert got["code"] | got["other"] == got["all"] == set(texts)
    with pytest.raises(EaglespecError, match="--topic"):
        regenerate(replace(cfg, out=str(tmp_path / "x.jsonl"), topic="prose"))
