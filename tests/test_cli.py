"""The CLI: bad input -> one clear line on stderr, exit code 2, no traceback."""

import json
import subprocess
import sys

import pytest

from conftest import good_head, tiny_target


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = tiny_target("llama")
    model.save_pretrained(root / "model")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(128)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="w1", unk_token="w0", pad_token="w0")
    tok.save_pretrained(root / "model")
    good_head(model).save_pretrained(root / "head")
    other = tiny_target("llama", vocab=64)
    good_head(other).save_pretrained(root / "head_small_vocab")
    return root


def run(*args):
    r = subprocess.run([sys.executable, "-m", "eaglespec.cli", *args], capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout, r.stderr


def gen(d, *extra):
    return run("generate", "--model", str(d / "model"), "--head", str(d / "head"), "--no-chat", *extra)


def test_generate_json_eagle_equals_vanilla(tiny_dirs):
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "20", "--json")
    assert rc == 0, err
    e = json.loads(out)
    for key in ("text", "token_ids", "new_tokens", "rounds", "tau", "accept_lengths", "time_s", "tokens_per_s",
                "draft_time_s", "verify_time_s"):
        assert key in e
    rc, out, err = gen(tiny_dirs, "--prompt", "w5 w9 w17", "--max-new-tokens", "20", "--json", "--method", "vanilla")
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == e["token_ids"]


def test_generate_streams_text(tiny_dirs):
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
])
def test_bad_input(tiny_dirs, extra, msg):
    rc, out, err = gen(tiny_dirs, *extra)
    assert rc == 2
    assert msg in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_model():
    rc, _, err = run("generate", "--model", "no-such-model", "--prompt", "hi")
    assert rc == 2 and "unknown model" in err and "Traceback" not in err


def test_head_that_does_not_fit(tiny_dirs):
    rc, _, err = run("generate", "--model", str(tiny_dirs / "model"), "--head", str(tiny_dirs / "head_small_vocab"),
                     "--no-chat", "--prompt", "w3")
    assert rc == 2 and "vocab_size: head 64 vs target 128" in err and "Traceback" not in err


def test_corrupt_and_foreign_checkpoints(tiny_dirs, tmp_path):
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
    assert rc == 2 and "not an eaglespec draft head" in err
