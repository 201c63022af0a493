"""Rebuild a trained head's reduced draft vocabulary from the target's own answers.

`train --init` keeps the starting head's draft vocabulary; one chosen from ChatGPT-written ShareGPT
answers left out 4.4 % of SmolLM2's own answer tokens
(" billion", " smartphone", ...), which the head could then never propose. The head's weights do
not depend on the vocabulary (it predicts features; the draft LM head is rows of the target's), so
a new one needs no training. The new vocabulary: the assistant tokens of the given feature shards
(their `token_counts`), most frequent first, then the old vocabulary's lowest ids (BPE merge order,
roughly frequency) up to the same size, plus EOS (`train.trainer.draft_vocabulary` with `fill`).
`train --init HEAD --revocab` does the same before training; this script is for a head already trained.

    python scripts/revocab.py HEAD_IN FEATURES_DIR[,FEATURES_DIR...] HEAD_OUT [MODEL]
"""

import sys
from pathlib import Path

from eaglespec import EagleDraftHead, load_target
from eaglespec.io import short_path
from eaglespec.models import eos_ids
from eaglespec.train.extract import read_shard, shard_files
from eaglespec.train.trainer import draft_vocabulary


def main(head_in: str, features: str, head_out: str, model_name: str = "smollm2-135m-instruct") -> None:
    model, tok = load_target(model_name)
    folders = features.split(",")
    counts = sum(read_shard(p)["token_counts"] for f in folders for p in shard_files(Path(f).expanduser() / "train"))
    head = EagleDraftHead.from_pretrained(head_in, model)
    old = set(head.d2t.tolist())
    head.set_draft_vocab(draft_vocabulary(counts, len(old), eos_ids(tok, model), fill=sorted(old)))
    head.metadata["draft_vocab_rebuilt_from"] = ",".join(short_path(f) for f in folders)
    head.save_pretrained(head_out)
    print(f"{head.d2t.numel()} draft tokens, {len(set(head.d2t.tolist()) - old)} new")


if __name__ == "__main__":
    main(*sys.argv[1:5])
