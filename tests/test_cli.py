"""The CLI: bad input -> one clear line on stderr, exit code 2, no traceback."""

import json
import subprocess
import sys

import pytest
import torch



def run_subprocess(*args):
    r = subprocess.run([sys.executable, "-m", "eaglespec.cli", *args], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(autouse=True)
def cost_curves(tmp_path_factory, monkeypatch):
    """The CLI's default tree on a CPU (auto+lookup) measures a cost curve once: into a cache of
    this test session, not the user's (the subprocesses inherit it)."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path_factory.getbasetemp() / "cli_cache"))


@pytest.fixture
def run(capsys):
    """The CLI in-process (fast); `test_subprocess_exit_code` checks the real process once."""
    from eaglespec.cli import main

    def call(*args):
        rc = main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err
    return call


@pytest.fixture
def gen(run):
    return lambda d, *extra: run("generate", "--model", str(d / "model"), "--head", str(d / "head"), "--no-chat", *extra)


def test_subprocess_exit_code(tiny_dirs):
    rc, out, err = run_subprocess("generate", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"),
                                  "--no-chat", "--prompt", "w3", "--top-p", "2")
    assert rc == 2 and err.strip() == "eaglespec: error: top_p must be in (0, 1], got 2.0"


def test_generate_json_eagle_equals_vanilla(tiny_dirs, gen):
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "20", "--json")
    assert rc == 0, err
    e = json.loads(out)
    assert e["tree"] == "auto+lookup"  # the CPU's default tree
    for key in ("text", "token_ids", "new_tokens", "rounds", "tau", "accept_lengths", "time_s", "tokens_per_s",
                "draft_time_s", "verify_time_s"):
        assert key in e
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "20", "--json", "--method", "vanilla")
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == e["token_ids"]
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "20", "--json", "--draft-vocab", "full")
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == e["token_ids"]


def test_default_tree_is_the_cost_curve_s_on_a_cpu_and_the_paper_s_elsewhere():
    from eaglespec.cli import build_parser, default_tree

    assert default_tree("cpu") == "auto+lookup" and default_tree("cuda:0") == default_tree("cuda") == "paper"
    assert build_parser().parse_args(["generate", "--prompt", "x"]).tree is None  # resolved by main per --device


def test_generate_streams_text(tiny_dirs, gen):
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9", "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "1")
    assert rc == 0, err
    assert out.strip().startswith("w")


@pytest.mark.parametrize("extra,msg", [
    (["--prompt", "   "], "empty prompt"),
    (["--prompt", "w3", "--max-new-tokens", "0"], "max-new-tokens"),
    (["--prompt", "w3", "--temperature", "-1"], "temperature"),
    (["--prompt", "w3", "--temperature", "1", "--top-p", "0"], "top_p"),
    (["--prompt", "w3", "--top-p", "1.5"], "top_p"),
    (["--prompt", "w3", "--top-k", "-2"], "top_k"),
    (["--prompt", " ".join(["w3"] * 600)], "context"),
    (["--prompt", "w3", "--tree", "bushy"], "unknown tree"),
    (["--prompt", "w3", "--tree", "dynamic:9,9"], "DEPTH"),
    (["--prompt", "w3", "--sampled-tree", "bushy"], "unknown tree"),
    (["--prompt", "w3", "--compile", "--quantize", "int8"], "plain fp32"),
    (["--prompt", "w3", "--temperature", "1e-40"], "temperature must be 0 (greedy) or"),
    (["--prompt", "w3", "--device", "foo"], "--device must be cpu or cuda"),
    (["--prompt", "w3", "--device", "cuda:7"], "no such device"),
    (["--prompt", "w3", "--temperature", "1", "--seed", str(2**70)], "--seed must be in"),
])
def test_bad_input(tiny_dirs, gen, extra, msg):
    rc, out, err = gen(tiny_dirs, *extra)
    assert rc == 2
    assert msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("extra,msg", [(["--unroll", "-1"], "unroll must be >= 0"),
                                       (["--unroll-fraction", "1.5"], "unroll_fraction must be in (0, 1]"),
                                       (["--lr", "-1"], "lr must be > 0")])
def test_bad_train_settings(tmp_path, run, extra, msg):
    rc, _, err = run("train", "--features", str(tmp_path), "--out", str(tmp_path / "run"), *extra)
    assert rc == 2 and msg in err and "Traceback" not in err


def test_an_internal_error_is_one_line_and_exit_code_1(tiny_dirs, gen, monkeypatch):
    """A bug of ours (here: the engine fails mid-decode) ends in one line and exit code 1, not a traceback."""
    from eaglespec.spec import engine

    def broken(*a, **kw):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(engine.Engine, "_verify", broken)
    rc, _, err = gen(tiny_dirs, "--prompt", "w3 w5", "--max-new-tokens", "8")
    assert rc == 1 and "internal error: RuntimeError: boom" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_an_unsupported_transformers_is_refused_in_one_line(run, monkeypatch):
    """transformers outside the tested range: the CLI says so in one line and exits 2."""
    from eaglespec import cli, platform

    assert platform.unsupported_transformers("4.57.6") is None
    for version in ("5.16.1", "4.40.0", "6.0.0.dev0"):
        assert "is not supported" in platform.unsupported_transformers(version)
    monkeypatch.setattr(cli, "unsupported_transformers", lambda: platform.unsupported_transformers("5.16.1"))
    rc, _, err = run("generate", "--prompt", "hi")
    assert rc == 2 and "transformers 5.16.1 is not supported" in err and len(err.strip().splitlines()) == 1


def test_unknown_model(run):
    rc, _, err = run("generate", "--model", "no-such-model", "--prompt", "hi")
    assert rc == 2 and "unknown model" in err and "Traceback" not in err


def test_head_that_does_not_fit(tiny_dirs, run):
    rc, _, err = run("generate", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head_small_vocab"),
                     "--no-chat", "--prompt", "w3")
    assert rc == 2 and "vocab_size: head 64 vs target 128" in err and "Traceback" not in err


def test_corrupt_and_foreign_checkpoints(tiny_dirs, tmp_path, run):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dirs / "head", bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    rc, _, err = run("generate", "--model", str(tiny_dirs / "model"), "--head", str(bad), "--no-chat", "--prompt", "w3")
    assert rc == 2 and "model.safetensors" in err and "Traceback" not in err
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"model_type": "llama"}')
    rc, _, err = run("generate", "--model", str(tiny_dirs / "model"), "--head", str(foreign), "--no-chat", "--prompt", "w3")
    assert rc == 2 and "not a draft head eaglespec knows" in err


def _broken_head(src, dst, config=None, tensors=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("name,config,tensors,msg", [
    ("layer_config", lambda c: c.update(layer_config=[1, 2]), None, "layer_config must be a dict"),
    ("version", lambda c: c.update(format_version="1"), None, "format_version must be an integer"),
    ("hidden", lambda c: c.update(hidden_size=-4), None, "hidden_size must be a positive int"),
    ("d2t", None, lambda s: s.update(d2t=torch.zeros(0, dtype=torch.long)), "d2t is not a valid"),
    ("d2t_float", None, lambda s: s.update(d2t=torch.zeros(4)), "d2t is not a valid"),
    # sizes the file does not have are refused before anything of that size is allocated
    ("huge", lambda c: c["layer_config"].update(intermediate_size=10**9), None, "has shape"),
    ("layers", lambda c: c["layer_config"].update(num_hidden_layers=10**6), None, "layers are not the file's"),
])
def test_malformed_head_files_are_one_clear_line(tiny_dirs, tmp_path, run, name, config, tensors, msg):
    bad = _broken_head(tiny_dirs / "head", tmp_path / name, config, tensors)
    rc, _, err = run("generate", "--model", str(tiny_dirs / "model"), "--head", str(bad), "--no-chat", "--prompt", "w3")
    assert rc == 2 and msg in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_profile_writes_curve_and_auto_uses_it(tiny_dirs, run, gen, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    rc, out, err = run("profile", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"),
                       "--context", "32", "--repeats", "1", "--out", str(tmp_path / "p"))
    assert rc == 0, err
    prof = json.loads((tmp_path / "p" / "cost_curve.json").read_text())
    assert len(prof["verify_s"]) == len(prof["sizes"]) and prof["draft_level_s"] > 0
    assert (tmp_path / "p" / "cost_curve.png").stat().st_size > 0 and "| tokens | ms |" in out
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "12", "--json", "--tree", "auto")
    assert rc == 0, err
    assert "measuring" not in err  # the profile just written is reused
    rc, van, _ = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "12", "--json", "--method", "vanilla")
    assert json.loads(out)["token_ids"] == json.loads(van)["token_ids"]


def test_sampled_requests_say_which_tree_drafted_them(tiny_dirs, gen):
    """On a CPU the default tree (auto+lookup) drafts one sampled token a round at T > 0, and the
    JSON says so; --sampled-tree same keeps auto+lookup."""
    args = ("--prompt", "w5 w9 w17", "--max-new-tokens", "8", "--json", "--temperature", "1", "--seed", "3")
    rc, out, err = gen(tiny_dirs, *args)
    assert rc == 0, err
    assert json.loads(out)["tree"] == "chain:1"
    rc, out, err = gen(tiny_dirs, *args, "--sampled-tree", "same")
    assert rc == 0, err
    assert json.loads(out)["tree"] == "auto+lookup"


def test_profile_compare_overlays_saved_curves(run, tmp_path):
    from eaglespec.policy.costmodel import CostProfile

    for name, scale in (("a", 1.0), ("b", 0.4)):
        CostProfile([1, 2, 4], [0.08 * scale, 0.09 * scale, 0.1 * scale], 0.01 * scale, 64, {"model": "m"}).save(
            tmp_path / f"{name}.json")
    rc, out, err = run("profile", "--compare", f"fp32={tmp_path / 'a.json'}", f"int4={tmp_path / 'b.json'}",
                       "--out", str(tmp_path / "cmp"))
    assert rc == 0, err
    assert "| tokens | fp32 (ms) | int4 (ms) |" in out and "| 4 | 100 | 40 |" in out
    assert (tmp_path / "cmp" / "cost_curve.png").stat().st_size > 0
    (tmp_path / "bad.json").write_text("{not json")
    for args in ([f"x={tmp_path / 'bad.json'}"], [str(tmp_path / "a.json")], [f"x={tmp_path / 'missing.json'}"]):
        rc, out, err = run("profile", "--compare", *args, "--out", str(tmp_path / "cmp"))
        assert rc == 2 and err.startswith("eaglespec: error:") and "Traceback" not in err


@pytest.mark.parametrize("quant", ["int8", "int4", "bf16-dot", "int4-dot"])
def test_generate_quantized_target(tiny_dirs, gen, quant):
    """--quantize: eagle and vanilla run the same quantized target, so their tokens agree."""
    from eaglespec.cpu.kernels import bf16dot_available
    from eaglespec.cpu.quant import int4_available

    if quant == "int4" and not int4_available():
        pytest.skip("torch has no CPU int4 kernel")
    if quant.endswith("-dot") and not bf16dot_available():
        pytest.skip("no AVX512-BF16 here")
    outs = []
    for method in ("eagle", "vanilla"):
        rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "16", "--json", "--method", method,
                           "--quantize", quant)
        assert rc == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_quantize_fastest_is_int4_q8_or_int4_dot_where_the_cpu_runs_it(tiny_dirs, gen, monkeypatch):
    """--quantize fastest: int4-q8 with AVX512-VNNI, else int4-dot with AVX512-BF16, else int4, resolved
    before anything loads."""
    from eaglespec.cpu import kernels
    from eaglespec.cpu.quant import fastest_quantizer, int4_available

    want = "int4-q8" if kernels.q4q8_available() else "int4-dot" if kernels.bf16dot_available() else "int4"
    assert fastest_quantizer() == want
    if want == "int4" and not int4_available():
        pytest.skip("no int4 kernel here")
    outs = []
    for quant in ("fastest", want):
        rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "12", "--json", "--quantize", quant)
        assert rc == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1]
    # the Python API takes "fastest" too, and the model says which kind it got
    from eaglespec.cpu.quant import target_kernels
    from eaglespec.models import load_target

    model, _ = load_target(str(tiny_dirs / "model"), quantize="fastest")
    assert target_kernels(model).quantization == want
    monkeypatch.setattr(kernels, "q4q8_available", lambda: False)
    assert fastest_quantizer() == ("int4-dot" if kernels.bf16dot_available() else "int4")
    monkeypatch.setattr(kernels, "bf16dot_available", lambda: False)
    assert fastest_quantizer() == "int4"


def test_cli_names_every_quantizer():
    """cli keeps its own copy of the --quantize choices (so that --help imports no torch)."""
    from eaglespec import cli
    from eaglespec.cpu.quant import QUANTIZERS

    assert cli.QUANTIZERS == QUANTIZERS


def test_serve_bad_settings(tiny_dirs, run):
    import socket

    base = ("serve", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"))
    for extra, msg in ((["--port", "70000"], "--port must be in 0..65535"), (["--max-tokens", "0"], "--max-tokens")):
        rc, out, err = run(*base, *extra)
        assert rc == 2 and msg in err and len(err.strip().splitlines()) == 1
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc, out, err = run(*base, "--port", str(busy.getsockname()[1]))
    assert rc == 2 and "cannot listen on 127.0.0.1:" in err and "Traceback" not in err


def test_serve_subprocess_answers_and_stops(tiny_dirs):
    import signal
    import urllib.request

    p = subprocess.Popen([sys.executable, "-m", "eaglespec.cli", "serve", "--model", str(tiny_dirs / "model"),
                          "--head", str(tiny_dirs / "head"), "--port", "0", "--model-id", "tiny"],
                         stderr=subprocess.PIPE, text=True,
                         # a background shell's children ignore SIGINT, and so would the server
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = p.stderr.readline()
        while line.startswith("eaglespec: measuring"):  # the default tree's cost curve, before it listens
            line = p.stderr.readline()
        assert line.startswith("eaglespec: serving tiny (eagle, tree auto+lookup) at http://127.0.0.1:"), line
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w30 w31 w32"}], "temperature": 0,
                "max_tokens": 5}
        req = urllib.request.Request(line.split(" at ")[1].strip() + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())
        assert got["usage"]["completion_tokens"] == 5 and len(got["choices"][0]["message"]["content"].split()) == 5
    finally:
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        err = p.stderr.read()
    assert rc == 130 and "Traceback" not in err


def test_chat_keeps_the_conversation(tiny_dirs, run, monkeypatch):
    """Each line is a turn answered with the whole conversation so far; /reset forgets it; the answers
    are vanilla decoding's."""
    import io

    from eaglespec import Engine
    from eaglespec.models import load_target

    monkeypatch.setattr("sys.stdin", io.StringIO("w30 w31\n\nw7\n/reset\nw7\n/exit\nw9\n"))
    rc, out, err = run("chat", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"),
                       "--max-new-tokens", "6", "--stats")
    assert rc == 0, err
    model, tok = load_target(str(tiny_dirs / "model"))
    eng = Engine(model)

    def answer(msgs):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return tok.decode(eng.generate(ids, 6, method="vanilla", eos_token_ids=[1]).token_ids, skip_special_tokens=True)
    first = answer([{"role": "user", "content": "w30 w31"}])
    second = answer([{"role": "user", "content": "w30 w31"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "w7"}])
    fresh = answer([{"role": "user", "content": "w7"}])
    assert second != fresh  # the history matters, so the test can tell /reset from no reset
    assert out.splitlines() == [first, second, fresh]  # nothing after /exit
    assert err.count("tau") == 3


def test_chat_survives_a_conversation_longer_than_the_context(tiny_dirs, run, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(" ".join(["w3"] * 600) + "\nw7\n"))
    rc, out, err = run("chat", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head"),
                       "--max-new-tokens", "4")
    assert rc == 0 and "context" in err and "/reset" in err and "Traceback" not in err
    assert len(out.splitlines()) == 1  # the next line was answered
