"""The server under concurrent clients: aggregate tokens/s and per-request latency for 1, 4 and 8
clients, one request decoding at a time against requests decoded together (continuous batching).

    python -m eaglespec.bench.serving [--model M] [--clients 1,4,8] [--requests 16] --out DIR

Each setting is its own `EagleServer` on loopback over the same engine (the CLI's defaults: the
shipped head, `--tree auto+lookup`). Every cell sends the same MT-bench first turns (chat, T = 0 by
default): C clients take the next question as soon as their last answer came. A cell's tokens/s is
all completion tokens over the wall time from the first request to the last answer; latency is
each request's send-to-answer time (queueing included). Cells run interleaved, `--repeats` times;
tokens/s is the median over repeats, latencies are pooled. At T = 0 every answer is compared with
the target's vanilla decoding of the same question. Writes results.json, table.md and serving.png.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..platform import default_head
from .datasets import load_questions
from .harness import machine, write_run

# name -> (max_batch, batch_tree); the last is `eaglespec serve`'s default
SETTINGS = {"one at a time": (1, None), "batched, plain steps": (8, None), "batched, chain:1": (8, "chain:1")}


def _ask(url: tuple[str, int], body: dict) -> tuple[float, dict]:
    conn = http.client.HTTPConnection(*url, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data}")
    return time.perf_counter() - t0, data


def run_cell(url: tuple[str, int], questions: list[str], clients: int, max_tokens: int,
             temperature: float) -> dict[str, Any]:
    """C clients drain the questions; each answer's latency, text and token count."""
    nxt, lock = iter(range(len(questions))), threading.Lock()
    out: list[dict] = [{} for _ in questions]
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            body = {"messages": [{"role": "user", "content": questions[i]}], "max_tokens": max_tokens,
                    "temperature": temperature}
            try:
                latency, data = _ask(url, body)
            except Exception as e:  # noqa: BLE001 (reported in the results, never hidden)
                errors.append(f"{type(e).__name__}: {e}")
                return
            out[i] = {"latency_s": latency, "text": data["choices"][0]["message"]["content"],
                      "tokens": data["usage"]["completion_tokens"]}

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return {"wall_s": wall, "tokens": sum(o["tokens"] for o in out), "answers": out}


def run(model_name: str, clients: list[int], requests: int, max_tokens: int, temperature: float,
        repeats: int) -> dict[str, Any]:
    from ..models import Engine, eos_ids, load_target
    from ..server import serve
    from ..spec.head import EagleDraftHead
    from ..spec.verify import SamplingParams

    model, tok = load_target(model_name)
    head = EagleDraftHead.from_pretrained(default_head(model_name), model)
    engine = Engine(model, head, tree="auto+lookup")
    eos = eos_ids(tok, model)
    questions = [q["turns"][0] for q in load_questions("mt_bench", requests, spread=True)]
    servers = {}
    for name, (max_batch, batch_tree) in SETTINGS.items():
        srv = serve(engine, tok, model_name, eos, port=0, warm_up=False, max_batch=max_batch, batch_tree=batch_tree,
                    log_requests=False)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers[name] = srv
    want = None
    if temperature == 0:
        want = []
        for q in questions:
            ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            out = engine.generate(ids, max_tokens, SamplingParams(), "vanilla", eos_token_ids=eos)
            want.append(tok.decode(out.token_ids, skip_special_tokens=True))
    cells: dict[tuple[str, int], list[dict]] = {}
    try:
        for name, srv in servers.items():  # warm-up: each setting's paths once, several rows at once too
            run_cell(srv.server_address[:2], questions[:2], 2, 16, temperature)
        for rep in range(repeats):
            for c in clients:
                order = list(servers) if rep % 2 == 0 else list(servers)[::-1]
                for name in order:
                    cell = run_cell(servers[name].server_address[:2], questions, c, max_tokens, temperature)
                    cells.setdefault((name, c), []).append(cell)
                    print(f"  repeat {rep + 1}/{repeats}, {c} clients, {name}: "
                          f"{cell['tokens'] / cell['wall_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for srv in servers.values():
            srv.shutdown()
            srv.server_close()
    rows = []
    for (name, c), runs in cells.items():
        lat = [a["latency_s"] for r in runs for a in r["answers"]]
        rates = [r["tokens"] / r["wall_s"] for r in runs]
        row = {"setting": name, "clients": c, "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
               "p50_latency_s": statistics.median(lat),
               "p95_latency_s": statistics.quantiles(lat, n=20, method="inclusive")[-1] if len(lat) > 1 else lat[0],
               "requests": len(lat), "tokens": sum(r["tokens"] for r in runs)}
        if want is not None:
            row["greedy_equal"] = all(a["text"] == w for r in runs for a, w in zip(r["answers"], want))
        rows.append(row)
    base = {r["clients"]: r["tokens_per_s"] for r in rows if r["setting"] == "one at a time"}
    for r in rows:
        r["vs_one_at_a_time"] = r["tokens_per_s"] / base[r["clients"]] if base.get(r["clients"]) else None
    return {"machine": machine(), "config": {"model": model_name, "tree": "auto+lookup", "clients": clients,
                                             "requests": requests, "max_tokens": max_tokens,
                                             "temperature": temperature, "repeats": repeats,
                                             "settings": {k: {"max_batch": b, "batch_tree": t}
                                                          for k, (b, t) in SETTINGS.items()}},
            "summary": rows}


def table(result: dict) -> str:
    lines = ["| clients | setting | tok/s | vs one at a time | p50 latency | p95 latency | greedy = vanilla |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(result["summary"], key=lambda r: (r["clients"], list(SETTINGS).index(r["setting"]))):
        eq = {True: "yes", False: "NO", None: "n/a"}[r.get("greedy_equal")]
        lines.append(f"| {r['clients']} | {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_one_at_a_time']:.2f}x | "
                     f"{r['p50_latency_s']:.2f} s | {r['p95_latency_s']:.2f} s | {eq} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in SETTINGS:
        rs = sorted((r for r in result["summary"] if r["setting"] == name), key=lambda r: r["clients"])
        xs = [r["clients"] for r in rs]
        axes[0].plot(xs, [r["tokens_per_s"] for r in rs], marker="o", label=name)
        axes[1].plot(xs, [r["p95_latency_s"] for r in rs], marker="o", label=name)
    axes[0].set_ylabel("aggregate tokens/s")
    axes[1].set_ylabel("p95 latency (s)")
    for ax in axes:
        ax.set_xlabel("concurrent clients")
        ax.set_xticks(result["config"]["clients"])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(f"eaglespec serve, {result['config']['model']}, {result['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eaglespec.bench.serving", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16, help="MT-bench first turns per cell")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        clients = [int(c) for c in a.clients.split(",")]
    except ValueError:
        print(f"eaglespec: --clients must be whole numbers separated by commas, got {a.clients!r}", file=sys.stderr)
        return 2
    if min(clients) < 1 or a.requests < 1 or a.repeats < 1 or a.max_tokens < 1:
        print("eaglespec: --clients, --requests, --repeats and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    result = run(a.model, clients, a.requests, a.max_tokens, a.temperature, a.repeats)
    write_run(Path(a.out), result, table(result), "table.md", lambda png: plot(result, png), "serving.png")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
