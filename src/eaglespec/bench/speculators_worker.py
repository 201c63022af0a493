"""speculators' side of `eaglespec.bench.engines`'s layout check, run by the Python of vLLM's own
environment (speculators needs transformers 5.x), so it imports nothing of eaglespec's.

    python speculators_worker.py HEAD_DIR INPUTS.safetensors OUT.json

INPUTS: "hidden" (1, T, 3H) the target's fused layers, "input_ids" (1, T) the tokens beside them
(t_{j+1}), "logits" (T, draft vocabulary) eaglespec's draft logits for the same inputs. OUT: the
largest difference and whether the argmax agrees everywhere.
"""

import json
import os
import sys

# run as a script, this file's folder leads sys.path, and its neighbours (datasets.py) would shadow
# the packages of the same names that vLLM and speculators import
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch
from safetensors.torch import load_file


def main() -> int:
    from speculators.models.eagle3 import Eagle3DraftModel

    head_dir, inputs, out = sys.argv[1:4]
    x = load_file(inputs)
    model = Eagle3DraftModel.from_pretrained(head_dir).float().eval()
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    T = x["input_ids"].shape[1]
    with torch.no_grad():
        model(hidden_states=x["hidden"].float(), input_ids=x["input_ids"].long(),
              document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=1)
    theirs, ours = seen[0][0].float(), x["logits"].float()
    json.dump({"max_abs_diff": float((theirs - ours).abs().max()), "scale": float(ours.abs().max()),
               "argmax_equal": bool(torch.equal(theirs.argmax(-1), ours.argmax(-1)))}, open(out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
