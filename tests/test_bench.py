"""The harness end to end on a tiny model: files, fields, and the greedy-equality check."""

import json

import pytest

from conftest import SHARED


def test_bench_end_to_end(tiny_dirs, tmp_path, capsys):
    from eaglespec.cli import main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question_id": i, "category": "x", "turns": [f"w{5 + i} w9", "w7"]})
                               for i in range(3)))
    datasets = [str(qfile)]
    if (SHARED / "data" / "eval" / "gsm8k" / "question.jsonl").is_file():
        datasets.append("gsm8k")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"),
               # a static tree: `auto` may rightly stop drafting on a loaded machine, and tau > 1 is checked below
               "--dataset", ",".join(datasets), "--limit", "2", "--temperature", "0,1", "--max-new-tokens", "12",
               "--tree", "paper",
               "--methods", "vanilla,eagle,eagle-chain,hf,pld,llamacpp,eagle@dynamic:3,2,5", "--batch-size", "1,2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert (out / "report.md").is_file() and (out / "speedup.png").stat().st_size > 1000
    recs = res["records"]
    # two turns per question for the local file (multi-turn like MT-bench)
    assert {r["turn"] for r in recs if r["dataset"] == str(qfile)} == {0, 1}
    greedy = [r for r in recs if r["temperature"] == 0 and r["method"] != "vanilla"]
    assert greedy and all(r["equal_to_vanilla"] for r in greedy)
    rows = {(r["dataset"], r["temperature"], r["method"]): r for r in res["summary"]}
    eagle = rows[(str(qfile), 0.0, "eagle")]
    for key in ("tokens_per_s", "speedup_vs_vanilla", "speedup_vs_hf", "median_ratio_vs_vanilla", "tau", "n_alpha",
                "time_split", "free_draft_speedup", "greedy_equal"):
        assert key in eagle
    assert eagle["greedy_equal"] is True and eagle["tau"] > 1
    assert rows[(str(qfile), 0.0, "eagle@dynamic:3,2,5")]["greedy_equal"] is True  # a tree-ablation row
    assert (str(qfile), 1.0, "pld") not in rows and "pld@T=1.0" in res["skipped"]
    report = (out / "report.md").read_text()
    assert "| eagle |" in report and "not run" in report
    # llama.cpp needs the registry model's GGUF (or the package): said, not silently dropped
    assert "llamacpp" in res["skipped"] and "`llamacpp` not run" in report
    # the batch table: vanilla vs eagle with two prompts decoded together, same tokens at T=0
    batch = {(r["dataset"], r["temperature"]): r for r in res["batch_summary"]}
    b0 = batch[(str(qfile), 0.0)]
    assert b0["batch_size"] == 2 and b0["batches"] == 1 and b0["greedy_equal"] is True and b0["tau"] > 1
    assert b0["speedup"] > 0 and batch[(str(qfile), 1.0)]["greedy_equal"] is None
    assert 0 < b0["eagle_occupancy"] <= 1 and b0["eagle_ms_per_round"] > 0
    assert abs(sum(b0["eagle_time_split"].values()) - 1) < 1e-9 and b0["eagle_time_split"]["verify"] > 0
    assert "## batch sizes" in report


def test_bench_rejects_bad_method(tiny_dirs, tmp_path, capsys):
    from eaglespec.cli import main

    assert main(["bench", "--model", str(tiny_dirs / "model"), "--methods", "vanilla,medusa", "--out",
                 str(tmp_path)]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_decode_speedup_leaves_the_prefill_out():
    """Both spend 0.5 s on the prompt; vanilla decodes its other 10 tokens in 0.5 s, EAGLE in 0.25 s:
    2x after the prefill, 1.33x overall."""
    from types import SimpleNamespace

    from eaglespec.bench.harness import report_markdown, summarize

    recs = [{"dataset": "d", "temperature": 0.0, "method": m, "question_id": 0, "turn": 0, "new_tokens": 11,
             "time_s": t, "prefill_time_s": 0.5} for m, t in (("vanilla", 1.0), ("eagle", 0.75))]
    recs.append({"dataset": "d", "temperature": 0.0, "method": "hf", "question_id": 0, "turn": 0, "new_tokens": 11,
                 "time_s": 1.2})  # no prefill timing: no ratio rather than a wrong one
    rows = {r["method"]: r for r in summarize(recs, SimpleNamespace(methods=["vanilla", "eagle", "hf"]))}
    assert rows["eagle"]["decode_speedup_vs_vanilla"] == pytest.approx(2.0)
    assert rows["eagle"]["speedup_vs_vanilla"] == pytest.approx(4 / 3)
    assert rows["hf"]["decode_speedup_vs_vanilla"] is None
    cfg = dict(model="m", head=None, tree="auto", chain="chain:5", max_new_tokens=8, limit=8, spread=True)
    mach = dict(cpu="c", threads=1, torch="t", transformers="x", date="now")
    md = report_markdown({"config": cfg, "machine": mach, "summary": list(rows.values()), "skipped": {}})
    assert "| 1.33x | 1.60x | 1.33x | 2.00x | n/a |" in md and "limit: 8 (spread)" in md


def test_free_draft_speedup_counts_only_the_target_s_forwards():
    """Vanilla verifies its 10 decoded tokens in 0.4 s, EAGLE in 0.2 s (plus 0.3 s of drafting), both
    after a 0.5 s prefill: with drafting free, 0.9 / 0.7 s for all 11 tokens, and 2x on the decoding alone."""
    from types import SimpleNamespace

    from eaglespec.bench.harness import summarize

    recs = [{"dataset": "d", "temperature": 0.0, "method": m, "question_id": 0, "turn": 0, "new_tokens": 11,
             "time_s": t, "prefill_time_s": 0.5, "verify_time_s": v, "draft_time_s": dr, "rounds": 5, "accepted": 10,
             "alpha_accepted": [], "alpha_total": []}
            for m, t, v, dr in (("vanilla", 1.0, 0.4, 0.0), ("eagle", 1.05, 0.2, 0.3))]
    recs.append({"dataset": "d", "temperature": 0.0, "method": "hf", "question_id": 0, "turn": 0, "new_tokens": 11,
                 "time_s": 1.2})
    rows = {r["method"]: r for r in summarize(recs, SimpleNamespace(methods=["vanilla", "eagle", "hf"]))}
    assert rows["eagle"]["free_draft_speedup"] == pytest.approx(0.9 / 0.7)
    assert rows["eagle"]["free_draft_decode_speedup"] == pytest.approx(2.0)
    assert rows["vanilla"]["free_draft_speedup"] == pytest.approx(1.0) and rows["hf"]["free_draft_speedup"] is None
    assert rows["eagle"]["speedup_vs_vanilla"] < 1  # slower as run: the drafting ate the gain


def test_spread_questions_cover_the_set():
    from eaglespec.bench.datasets import load_questions, pick

    rows = list(range(80))
    assert pick(rows, 8, spread=True) == [0, 10, 20, 30, 40, 50, 60, 70]
    assert pick(rows, 3) == [0, 1, 2] and pick(rows, 3, spread=True) == [0, 26, 53]
    assert pick(rows, None, spread=True) == rows and pick(rows, 100, spread=True) == rows
    try:
        qs = load_questions("mt_bench", 8, spread=True)
    except Exception as e:  # the package or the shared file missing
        pytest.skip(str(e))
    assert len({q["category"] for q in qs}) == 8  # one of each MT-bench category


def test_report_names_the_kernels_the_target_ran_on():
    from eaglespec.bench.harness import report_markdown

    mach = dict(cpu="c", threads=1, torch="t", transformers="x", date="now")
    base = dict(model="m", head=None, tree="auto", chain="chain:5", max_new_tokens=8, limit=1)
    cases = [(dict(packed=True, packed_kernel="skinny"), "fp32 (skinny pre-packed)"),
             (dict(packed=True, packed_kernel="skinny-avx2"), "fp32 (skinny-avx2 pre-packed)"),
             (dict(packed=True, packed_kernel="oneDNN"), "fp32 (oneDNN pre-packed)"),
             (dict(quantize="int4", packed_kernel="skinny-avx2"), "int4 (eaglespec's 4-bit kernel, AVX2)"),
             (dict(packed=False), "target weights: fp32\n"),
             (dict(quantize="int4", packed_kernel="skinny", compile=True), "int4 (eaglespec's 4-bit kernel), torch.compile"),
             (dict(quantize="int4", packed_kernel=""), "int4 (torch's int4 kernel)")]
    for extra, label in cases:
        md = report_markdown({"config": {**base, **extra}, "machine": mach, "summary": [], "skipped": {}})
        assert label in md, (extra, md.splitlines()[2])


def test_batch_summary_counts_rounds_and_empty_slots():
    """A batch of 2 runs 4 rounds while one row finishes after 2: 6 of 8 row slots decoded."""
    from eaglespec.bench.harness import summarize_batches

    common = {"dataset": "d", "temperature": 0.0, "batch_size": 2, "batch": 0, "rows": 2}
    recs = [{**common, "method": "vanilla", "new_tokens": 8, "time_s": 0.4, "rounds": 4, "row_rounds": 8,
             "accepted": 8, "draft_time_s": 0.0, "verify_time_s": 0.3},
            {**common, "method": "eagle", "new_tokens": 8, "time_s": 0.2, "rounds": 4, "row_rounds": 6,
             "accepted": 9, "draft_time_s": 0.05, "verify_time_s": 0.1}]
    (row,) = summarize_batches(recs)
    assert row["vanilla_occupancy"] == 1.0 and row["eagle_occupancy"] == 0.75
    assert row["vanilla_ms_per_round"] == 100.0 and row["eagle_ms_per_round"] == 50.0
    assert row["speedup"] == 2.0 and row["tau"] == 1.5
    split = row["eagle_time_split"]
    assert (split["draft"], split["verify"]) == (0.25, 0.5) and abs(split["other"] - 0.25) < 1e-12


def test_a_batch_wider_than_the_question_set_is_refused_up_front(tiny_dirs, tmp_path, capsys):
    from eaglespec.cli import main

    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps({"question_id": i, "turns": [f"w{5 + i}"]}) for i in range(2)))
    rc = main(["bench", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"), "--dataset", str(qfile),
               "--methods", "vanilla,eagle", "--tree", "paper", "--batch-size", "1,4", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--batch-size 4 needs 4 questions per set" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything ran


def test_qwen_architecture_report_names_each_head_s_layer_and_judges_by_both_measures(tmp_path):
    """reproduce.py's arch-qwen section: each head's decoder layer from its config, and the verdict."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("reproduce", Path(__file__).parents[1] / "scripts" / "reproduce.py")
    rep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rep)
    machine = {"date": "2026-12-07 12:00 UTC", "commit": "abc1234", "cpu": "AMD EPYC (Zen 4)", "threads": 2}
    layers = {"eagle3": {"model_type": "llama", "attention_bias": False}, "hybrid": {"model_type": "qwen2"}}
    taus = {"eagle3": (1.80, 1.70), "hybrid": (1.70, 1.60)}
    rows = []
    for arch in ("eagle3", "hybrid"):
        (tmp_path / arch / "head").mkdir(parents=True)
        (tmp_path / arch / "head" / "config.json").write_text(json.dumps({"layer_config": layers[arch]}))
        (tmp_path / arch / "train_log.json").write_text(json.dumps(
            {"log": [{}] * 250, "tokens_seen": 490_000, "train_time_s": 3000.0}))
        (tmp_path / f"eval-{arch}").mkdir()
        (tmp_path / f"eval-{arch}" / "results.json").write_text(json.dumps({"machine": machine, "summary": [
            {"method": "eagle", "dataset": d, "tau": t} for d, t in zip(("humaneval", "mt_bench"), taus[arch])]}))
        acc = [0.4, 0.3, 0.2, 0.15, 0.1] if arch == "eagle3" else [0.35, 0.25, 0.15, 0.1, 0.05]
        rows += [{"head": str(tmp_path / arch / "head"), "split": s, "acc": acc} for s in ("qwen-code", "qwen-other")]
    (tmp_path / "heldout.json").write_text(json.dumps({"rows": rows}))
    text = "\n".join(rep._qwen_arch(tmp_path))
    assert "eagle3: Llama's, without q/k/v biases; hybrid: Qwen2's, with q/k/v biases" in text
    assert "| eagle3 | 250 steps, 0.49 M tokens, 50 min | 0.400 / 0.300 / 0.200 / 0.100 |" in text
    assert "EAGLE-3's head wins at this budget: tau +0.10 on HumanEval and +0.10 on MT-bench" in text
    assert rep._layer_kind(None) == "unknown"
