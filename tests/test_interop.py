"""Heads in other engines' layouts: official EAGLE-1, SafeAILab EAGLE-3, speculators; official EAGLE
(eagle-llm) running an exported head."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglespec import Engine
from eaglespec.cli import main
from eaglespec.errors import CheckpointError, EaglespecError
from eaglespec.spec.formats import detect, export_head
from eaglespec.spec.head import EagleDraftHead

from conftest import save_tiny_dir, tiny_target, trained_head
from test_engine import PROMPTS, hf_greedy

LAYOUTS = {"eagle1": ["eagle1"], "eagle3": ["eagle3", "speculators"]}


def draft_logits(head, model, ids):
    """The head's draft logits on a prompt's target features (and aux layers), positions in parallel."""
    x = torch.tensor([ids])
    with torch.no_grad():
        hs = model.model(input_ids=x, output_hidden_states=True).hidden_states
        f = torch.cat([hs[-1]] + [hs[i] for i in head.aux_layers], -1)
        return head.logits(head(f, torch.roll(x, -1, 1), torch.arange(len(ids))[None]))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_each_foreign_layout_round_trips_and_decodes_losslessly(arch, family, tmp_path):
    """A head written in each foreign layout is detected, reads back to the same draft logits, and
    decodes to the target's greedy output; the files hold what the layout says (EAGLE-1's FC columns
    [embedding ; feature] and the target's embedding, EAGLE-3's d2t offsets and t2d). A Qwen2 target's
    head travels as a Llama layer with attention biases (o's zero), read back as such."""
    model = tiny_target(family, layers=6)
    head = trained_head(model, arch, PROMPTS, aux_layers=[2, 3, 3] if arch == "eagle3" else None, steps=80)
    H = model.config.hidden_size
    for layout in LAYOUTS[arch]:
        out = export_head(head, layout, tmp_path / layout, model.config)
        assert detect(out) == layout
        back = EagleDraftHead.from_pretrained(out, model, draft_vocab="head")
        assert back.arch == arch and back.aux_layers == head.aux_layers
        assert back.metadata == {"imported_from": layout} and back.model_type == family
        assert back.layer_config.model_type == "llama" and back.layer_config.attention_bias == (family == "qwen2")
        torch.testing.assert_close(draft_logits(back, model, PROMPTS[2]), draft_logits(head, model, PROMPTS[2]),
                                   atol=0, rtol=0)
        eng = Engine(model, back, tree="paper")
        assert [eng.generate(p, 30).token_ids for p in PROMPTS] == [hf_greedy(model, p, 30) for p in PROMPTS]
    if arch == "eagle1":
        state = torch.load(tmp_path / "eagle1" / "pytorch_model.bin", weights_only=True)
        torch.testing.assert_close(state["fc.weight"][:, :H], head.fc.weight[:, H:])  # embedding columns first
        torch.testing.assert_close(state["embed_tokens.weight"], model.model.embed_tokens.weight)
        assert not any("input_layernorm" in k for k in state)
    else:
        state = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
        ids = torch.arange(model.config.vocab_size)
        assert torch.equal(state["d2t"] + torch.arange(state["d2t"].numel()), ids) and bool(state["t2d"].all())
        assert "midlayer.hidden_norm.weight" in state and "lm_head.weight" in state
        cfg = json.loads((tmp_path / "speculators" / "config.json").read_text())
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3] and cfg["speculators_model_type"] == "eagle3"


def test_a_reduced_draft_vocabulary_travels_as_offsets(tmp_path):
    model = tiny_target("llama", layers=6)
    d2t = torch.tensor([1, 4, 5, 9, 60, 127])
    head = EagleDraftHead(model.config, arch="eagle3", draft_vocab=d2t).bind(model).warm_start(model)
    assert head.aux_layers == [2, 3, 3]  # EAGLE-3's own choice for 6 layers
    export_head(head, "eagle3", tmp_path / "h", model.config)
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    assert state["d2t"].tolist() == [1, 3, 3, 6, 56, 122] and state["t2d"].sum() == 6
    back = EagleDraftHead.from_pretrained(tmp_path / "h", model)
    assert back.d2t.tolist() == d2t.tolist() and back.draft_vocab_size == 6


def test_a_hub_repo_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    """"owner/name" reads the local Hugging Face cache's snapshot (offline); one not there is one clear error."""
    model = tiny_target("llama", layers=6)
    head = trained_head(model, "eagle1", PROMPTS, steps=5)
    snap = tmp_path / "hub" / "models--someone--tiny-eagle" / "snapshots" / "abc123"
    export_head(head, "eagle1", snap, model.config)
    (tmp_path / "hub" / "models--someone--tiny-eagle" / "refs").mkdir()
    (tmp_path / "hub" / "models--someone--tiny-eagle" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    back = EagleDraftHead.from_pretrained("someone/tiny-eagle", model)
    assert back.arch == "eagle1"
    with pytest.raises(CheckpointError, match="local hub cache"):
        EagleDraftHead.from_pretrained("someone/not-there", model)


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/eaglespec-pickle-ran",))


def test_foreign_files_are_read_as_tensors_only_and_bad_ones_are_one_clear_error(tmp_path):
    model = tiny_target("llama", layers=6)
    head = trained_head(model, "eagle1", PROMPTS, steps=2)
    good = export_head(head, "eagle1", tmp_path / "good", model.config)
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((good / "config.json").read_text())
    with open(evil / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": Boom()}, f, protocol=2)  # torch.save's protocol: the refusal, not a protocol warning
    if os.path.exists("/tmp/eaglespec-pickle-ran"):
        os.unlink("/tmp/eaglespec-pickle-ran")
    with pytest.raises(CheckpointError, match="not a plain tensor file"):
        EagleDraftHead.from_pretrained(evil, model)
    assert not os.path.exists("/tmp/eaglespec-pickle-ran")  # never unpickled as code
    state = torch.load(good / "pytorch_model.bin", weights_only=True)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((good / "config.json").read_text())
    torch.save({**state, "fc.weight": state["fc.weight"][:, :10]}, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="fc.weight"):
        EagleDraftHead.from_pretrained(bad, model)
    torch.save({k: v for k, v in state.items() if "mlp.up_proj" not in k}, bad / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="missing"):
        EagleDraftHead.from_pretrained(bad, model)
    other = tiny_target("llama", vocab=64, layers=6)
    with pytest.raises(EaglespecError, match="vocab_size"):
        EagleDraftHead.from_pretrained(good, other)
    e3 = trained_head(model, "eagle3", [], aux_layers=[2, 3, 3], steps=1)
    spec = export_head(e3, "speculators", tmp_path / "spec", model.config)
    cfg = json.loads((spec / "config.json").read_text())
    (spec / "config.json").write_text(json.dumps({**cfg, "norm_before_residual": True}))
    with pytest.raises(CheckpointError, match="extra norms"):
        EagleDraftHead.from_pretrained(spec, model)
    (spec / "config.json").write_text(json.dumps({**cfg, "speculators_model_type": "mlp"}))
    with pytest.raises(CheckpointError, match="reads eagle3"):
        EagleDraftHead.from_pretrained(spec, model)
    st = load_file(str(tmp_path / "spec" / "model.safetensors"))
    (spec / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in st.items() if k != "lm_head.weight"}, str(spec / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head"):
        EagleDraftHead.from_pretrained(spec, model)


def test_export_refuses_what_a_layout_cannot_hold(tmp_path):
    model = tiny_target("llama", layers=6)
    hybrid = EagleDraftHead(model.config).bind(model)
    with pytest.raises(EaglespecError, match="only arch eagle1"):
        export_head(hybrid, "eagle1", tmp_path / "a", model.config)
    e3 = EagleDraftHead(model.config, arch="eagle3", aux_layers=[1, 3, 5]).bind(model)
    with pytest.raises(EaglespecError, match="SafeAILab"):
        export_head(e3, "eagle3", tmp_path / "b", model.config)
    export_head(e3, "speculators", tmp_path / "c", model.config)  # speculators names its layers
    other = EagleDraftHead(model.config, arch="eagle1").bind(model)
    other.layer_config.model_type = "phi3"  # a family whose layer has no Llama form (Llama and Qwen2 have)
    with pytest.raises(EaglespecError, match="no such form"):
        export_head(other, "eagle1", tmp_path / "d", model.config)


def test_export_cli(tmp_path, capsys):
    root = save_tiny_dir(tmp_path)
    model = tiny_target("llama", device="cpu")
    trained_head(model, "eagle1", PROMPTS, steps=2).save_pretrained(root / "e1")
    assert main(["export", str(root / "e1"), "--format", "eagle1", "--out", str(root / "out"),
                 "--model", str(root / "model")]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "eagle1" and detect(root / "out") == "eagle1"
    assert main(["export", str(root / "head"), "--format", "eagle1", "--out", str(root / "x"),
                 "--model", str(root / "model")]) == 2
    assert "arch is hybrid" in capsys.readouterr().err
    for fmt in ("eaglespec", "eagle1"):  # --dtype casts every layout's weights (a shipped head in bf16)
        assert main(["export", str(root / "e1"), "--format", fmt, "--dtype", "bfloat16", "--out",
                     str(root / f"bf16-{fmt}"), "--model", str(root / "model")]) == 0
        written = next(f for f in (root / f"bf16-{fmt}").iterdir() if f.suffix in (".safetensors", ".bin"))
        tensors = (load_file(str(written)) if written.suffix == ".safetensors"
                   else torch.load(written, weights_only=True))
        assert {v.dtype for v in tensors.values() if v.is_floating_point()} == {torch.bfloat16}


# -- official EAGLE (eagle-llm, pip install --no-deps eagle-llm==1.2.1) ------------------------------
def official_eagle():
    try:
        from eagle.model.ea_model import EaModel
    except ImportError:
        pytest.skip("eagle-llm is not installed (pip install --no-deps eagle-llm==1.2.1)")
    return EaModel


def test_official_eagle_decodes_an_exported_eagle1_head(tmp_path):
    """eagle-llm loads the exported head strictly, computes the same draft features as eaglespec's
    head on the same inputs, and its `eagenerate` greedy output is the target's."""
    EaModel = official_eagle()
    root = save_tiny_dir(tmp_path)
    model = tiny_target("llama", device="cpu")
    prompt = PROMPTS[0]
    head = trained_head(model, "eagle1", [prompt], steps=150)
    export_head(head, "eagle1", root / "eagle1", model.config)
    ea = EaModel.from_pretrained(base_model_path=str(root / "model"), ea_model_path=str(root / "eagle1"),
                                 dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        f = model.model(input_ids=x).last_hidden_state
        nxt = torch.roll(x, -1, 1)
        torch.testing.assert_close(ea.ea_layer(f, nxt), head(f, nxt, torch.arange(len(prompt))[None]),
                                   atol=1e-5, rtol=1e-5)
        out = ea.eagenerate(x, temperature=0.0, max_new_tokens=30)[0, len(prompt):].tolist()
    ref = hf_greedy(model, prompt, len(out))
    assert out == ref and len(out) >= 30
    assert Engine(model, head, tree="paper").generate(prompt, len(out)).token_ids == ref


def test_engine_table_rows_read_each_engines_own_counts(tmp_path):
    from eaglespec.bench.engines import _llama_counts, head_summary, report, row
    from eaglespec.platform import default_head

    spec_log = ("0.01 I encoded   33 tokens in    0.135 seconds, speed:  244.651 t/s\n"
                "0.01 I decoded   13 tokens in    0.355 seconds, speed:   36.625 t/s\n")
    assert _llama_counts(spec_log) == (13, 0.135 + 0.355)
    plain_log = ("common_perf_print: prompt eval time =     338.67 ms /    33 tokens (   10.26 ms per token)\n"
                 "common_perf_print:        eval time =    1098.49 ms /    23 runs   (   47.76 ms per token)\n")
    assert _llama_counts(plain_log) == (24, (338.67 + 1098.49) / 1000)
    assert _llama_counts("nothing here") is None
    r = row("x", "fp32", "h", [([1, 2, 3, 4], 4, 2.0)], [([1, 2, 3, 4], 4, 1.0)], [2])
    assert r["plain_tokens_per_s"] == 2.0 and r["eagle_tokens_per_s"] == 4.0 and r["speedup"] == 2.0
    assert r["tau"] == 2.0 and r["prompts_equal"] == r["prompts"] == 1
    assert row("x", "fp32", "h", [([1], 1, 1.0)], [([2], 1, 1.0)], None)["prompts_equal"] == 0
    m = {"cpu": "c", "threads": 2, "host": "h", "date": "d", "commit": "x"}
    llama = {**row("llama.cpp (source)", "gguf", "h", [([1], 1, 1.0)] * 2, [([1], 1, 1.0), ([2], 1, 1.0)], [1, 1]),
             "prompts_equal_undrafted": 2}
    table = report({"machine": m, "prompts": 2, "max_new_tokens": 1, "repeats": 1, "rows": [r, llama]})
    assert "| yes |" in table and "**1 of 2 prompts** (2 of 2 against its EAGLE program drafting nothing)" in table
    assert table.count("drafting nothing (`--spec-type") == 1
    rec = {"steps": 164, "tokens_seen": 366903, "evals": [{"unroll_acc": [0.5, 0.4, 0.3, 0.2]}]}
    head = tmp_path / "head"
    head.mkdir()
    (head / "training.json").write_text(json.dumps(rec))
    said = head_summary(str(head))
    assert said == "trained 164 steps, 0.37 M tokens seen, held-out agreement at draft steps 1-3 0.500 / 0.400 / 0.300"
    assert head_summary(default_head("smollm2-135m-instruct", "eagle3")) == "the shipped `smollm2-135m-instruct`"
    assert head_summary(default_head("smollm2-135m-instruct", "hybrid")) == "the shipped `smollm2-135m-instruct-hybrid`"
    table = report({"machine": m, "prompts": 2, "max_new_tokens": 1, "repeats": 1, "heads": {"eagle3": said}, "rows": [r]})
    assert f"eagle3 head: {said}." in table


def test_shipped_heads_are_found_by_architecture(tmp_path, monkeypatch):
    """heads/<model> is a model's default head, whatever its architecture; heads/<model>-<arch> another
    architecture's. Asking for an architecture finds its own folder, else the default head when it
    is of that architecture, else nothing; a folder or hub id is returned as given."""
    from eaglespec import platform

    for name, arch in (("a", "eagle3"), ("b", "hybrid"), ("b-eagle3", "eagle3"), ("c", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({} if arch is None else {"arch": arch}))
    monkeypatch.setattr(platform, "SHIPPED_HEADS", tmp_path)
    found = {(m, h): platform.default_head(m, h) for m in "abcd" for h in (None, "eagle3", "hybrid", "eagle1")}
    where = {k: v and Path(v).name for k, v in found.items()}
    assert where == {("a", None): "a", ("a", "eagle3"): "a", ("a", "hybrid"): None, ("a", "eagle1"): None,
                     ("b", None): "b", ("b", "eagle3"): "b-eagle3", ("b", "hybrid"): "b", ("b", "eagle1"): None,
                     ("c", None): "c", ("c", "eagle3"): None, ("c", "hybrid"): "c", ("c", "eagle1"): None,
                     ("d", None): None, ("d", "eagle3"): None, ("d", "hybrid"): None, ("d", "eagle1"): None}
    assert platform.default_head("a", "org/repo") == "org/repo"


def test_a_llama_cpp_graph_without_layer_inputs_is_named_before_it_aborts(tmp_path, monkeypatch):
    """llama.cpp drafts EAGLE-3 only for target families whose graph records each layer's input: the
    check reads the source tree's graph file; a failed run is reported by its assertion line, not by
    the backtrace that follows it."""
    from eaglespec.bench.engines import _llama_failure, _without_echo
    from eaglespec.interop import llama_cpp_eagle3_gap

    models = tmp_path / "src" / "models"
    models.mkdir(parents=True)
    (models / "llama.cpp").write_text("for (int il = 0; il < n_layer; ++il) {\n    res->t_layer_inp[il] = inpL;\n")
    (models / "qwen2.cpp").write_text("for (int il = 0; il < n_layer; ++il) {\n    ggml_tensor * inpSA = inpL;\n")
    monkeypatch.setenv("EAGLESPEC_LLAMA_CPP", str(tmp_path))
    assert llama_cpp_eagle3_gap("llama") is None
    assert "qwen2 graph (qwen2.cpp) records no layer inputs" in llama_cpp_eagle3_gap("qwen2")
    assert llama_cpp_eagle3_gap("mistral") is None  # no such file to read: left to llama.cpp
    log = ("0.01.15 W load: control-looking token\n"
           "/src/llama-graph.cpp:1384: GGML_ASSERT(t_layer_inp[il] != nullptr && \"layer input tensor is null\") failed\n"
           "[New LWP 4564]\n30\t../sysdeps/unix/sysv/linux/wait4.c: No such file or directory.\n")
    assert "layer input tensor is null" in _llama_failure(log)
    assert _llama_failure("only\nthis\n") == "this" and _llama_failure("") == "no output"
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert _without_echo("\n\n" + prompt + "Hello", prompt) == "Hello"
    assert _without_echo("\n\n" + prompt.rstrip("\n") + "Hello\n", prompt) == "Hello"
