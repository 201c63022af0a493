"""The same engine on CUDA: greedy equality with vanilla on the GPU. Skipped only when CUDA is absent."""

import pytest
import torch

from eaglespec.engine import Engine

from conftest import good_head, tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equality_on_cuda(family):
    model = tiny_target(family).to("cuda")
    head = good_head(model)
    eng = Engine(model, head)
    ids = [5, 9, 17, 33, 2]
    van = eng.generate(ids, 40, method="vanilla")
    eag = eng.generate(ids, 40, method="eagle")
    assert eag.token_ids == van.token_ids
    assert max(eag.stats.accept_lengths) > 1


def test_sampling_runs_on_cuda():
    from eaglespec.verify import SamplingParams

    model = tiny_target("llama").to("cuda")
    eng = Engine(model, good_head(model), draft_sampling="sample")
    out = eng.generate([5, 9], 20, sampling=SamplingParams(0.8, 0.9, 20), seed=0)
    again = eng.generate([5, 9], 20, sampling=SamplingParams(0.8, 0.9, 20), seed=0)
    assert out.token_ids == again.token_ids and len(out.token_ids) == 20
