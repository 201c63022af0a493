"""The same engine and trainer on CUDA. Skipped only when CUDA is absent.

The whole tiny-model engine suite also runs on a GPU with EAGLESPEC_TEST_DEVICE=cuda
(`scripts/gpu_check.sh`); these tests are the ones that need two devices at once.
"""

import pytest
import torch
from safetensors.torch import load_file

from eaglespec import Engine
from eaglespec.spec.engine import sibling_q
from eaglespec.spec.head import EagleDraftHead
from eaglespec.train.trainer import TrainConfig, train
from eaglespec.spec.verify import SamplingParams, renormalise

from conftest import good_head, tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equality_on_cuda(family):
    model = tiny_target(family, device="cuda")
    head = good_head(model)
    eng = Engine(model, head)
    ids = [5, 9, 17, 33, 2]
    van = eng.generate(ids, 40, method="vanilla")
    eag = eng.generate(ids, 40, method="eagle")
    assert eag.token_ids == van.token_ids
    assert max(eag.stats.accept_lengths) > 1


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_output_equals_cpu_output(family):
    """The same weights on both devices: greedy EAGLE on the GPU writes what vanilla writes on the CPU."""
    cpu = tiny_target(family, device="cpu")
    gpu = tiny_target(family, device="cuda")
    ids = [7, 100, 3, 3, 64]
    want = Engine(cpu, good_head(cpu)).generate(ids, 40, method="vanilla").token_ids
    for tree in ("paper", "dynamic"):
        assert Engine(gpu, good_head(gpu), tree=tree).generate(ids, 40).token_ids == want


def test_sampling_runs_on_cuda_and_is_seeded():
    model = tiny_target("llama", device="cuda")
    eng = Engine(model, good_head(model), draft_sampling="sample")
    out = eng.generate([5, 9], 20, sampling=SamplingParams(0.8, 0.9, 20), seed=0)
    again = eng.generate([5, 9], 20, sampling=SamplingParams(0.8, 0.9, 20), seed=0)
    assert out.token_ids == again.token_ids and len(out.token_ids) == 20


def test_renormalising_a_subnormal_mass_on_cuda():
    """What is left of q after its earlier siblings can be a subnormal float32 total. CUDA divides by
    a Python number through its reciprocal (inf here), which made NaN laws and a failed draw in
    test_sampling_runs_on_cuda_and_is_seeded on an H200; the laws must stay exact distributions."""
    q = torch.zeros(8, device="cuda")
    q[0], q[3], q[5] = 1.0, 3e-39, 1e-39  # 1e-39 and 3e-39 are subnormal in float32
    law = sibling_q(q, [0], 3)
    assert law is not None and torch.isfinite(law).all()
    torch.testing.assert_close(law.cpu(), torch.tensor([0, 0, 0, 0.75, 0, 0.25, 0, 0]))
    # speculative_step renormalises its residual max(0, p - q) the same way
    r = torch.zeros(8, device="cuda")
    r[2], r[6] = 2e-39, 2e-39
    torch.testing.assert_close(renormalise(r).cpu(), torch.tensor([0, 0, 0.5, 0, 0, 0, 0.5, 0]))
    assert renormalise(torch.zeros(8, device="cuda")) is None


def test_training_on_cuda_matches_cpu(tiny_features, tmp_path):
    """Same features, seed and schedule: the GPU run's losses and head equal the CPU run's (fp32)."""
    root = tiny_features
    common = dict(features=str(root / "feats"), model=str(root / "model"), epochs=1, batch_tokens=128,
                  draft_vocab=0, eval_conversations=2, save_every=2, warmup_steps=2, lr=1e-3, max_steps=4)
    cpu = train(TrainConfig(out=str(tmp_path / "cpu"), arch="hybrid", **common))
    gpu = train(TrainConfig(out=str(tmp_path / "gpu"), arch="hybrid", device="cuda", **common))
    assert gpu["step"] == cpu["step"] == 4
    assert [r["loss"] for r in gpu["log"]] == pytest.approx([r["loss"] for r in cpu["log"]], rel=1e-3)
    a = load_file(str(tmp_path / "cpu" / "head" / "model.safetensors"))
    b = load_file(str(tmp_path / "gpu" / "head" / "model.safetensors"))
    assert a.keys() == b.keys() and all(b[k].device.type == "cpu" for k in b)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=1e-3)
    # a head trained on the GPU serves on the CPU
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    head = EagleDraftHead.from_pretrained(tmp_path / "gpu" / "head", model).eval()
    eng = Engine(model, head)
    assert eng.generate([5, 9, 17], 30).token_ids == eng.generate([5, 9, 17], 30, method="vanilla").token_ids
