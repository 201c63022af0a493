"""The OpenAI-compatible server (tiny target over real HTTP) and the text stream under it."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request

import pytest

from eaglespec import Engine
from eaglespec.spec.head import EagleDraftHead
from eaglespec.models import eos_ids, load_target
from eaglespec.server import serve
from eaglespec.text import TextStream
from eaglespec.spec.verify import SamplingParams


@pytest.fixture(scope="module")
def srv(tiny_dirs):
    model, tok = load_target(str(tiny_dirs / "model"))
    head = EagleDraftHead.from_pretrained(str(tiny_dirs / "head"), model)
    s = serve(Engine(model, head, tree="paper"), tok, "tiny", eos_ids(tok, model), port=0)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    yield s
    s.shutdown()
    s.server_close()


def vanilla(s, ids: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> tuple[str, list[int], str]:
    out = Engine(s.engine.model).generate(ids, n, SamplingParams(temperature), "vanilla", seed, s.eos)
    return s.tok.decode(out.token_ids, skip_special_tokens=True), out.token_ids, out.finish_reason


def chat_ids(s, text: str) -> list[int]:
    return list(s.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True))


def post(s, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(s.url + path, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_stream(s, path: str, body: dict) -> list:
    """The server-sent events of a streamed request: parsed chunks, then the literal "[DONE]"."""
    req = urllib.request.Request(s.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        events = [line[6:] for line in r.read().decode().split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_chat_greedy_is_vanilla_decoding(srv):
    status, r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5 w9"}],
                                                   "temperature": 0, "max_tokens": 24})
    assert status == 200, r
    prompt = chat_ids(srv, "w5 w9")
    text, ids, reason = vanilla(srv, prompt, 24)
    assert r["object"] == "chat.completion" and r["model"] == "tiny" and r["id"].startswith("chatcmpl-")
    assert r["choices"][0]["message"] == {"role": "assistant", "content": text}
    n = len(prompt)
    assert r["usage"] == {"prompt_tokens": n, "completion_tokens": len(ids), "total_tokens": n + len(ids)}
    assert r["choices"][0]["finish_reason"] == {"eos": "stop", "length": "length"}[reason]
    assert r["eaglespec"]["method"] == "eagle" and r["eaglespec"]["tau"] > 1  # drafts were accepted


def test_stream_is_the_same_text(srv):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "w30 w31 w32"}]}], "temperature": 0,
            "max_tokens": 24, "stream_options": {"include_usage": True}}
    events = post_stream(srv, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == vanilla(srv, chat_ids(srv, "w30 w31 w32"), 24)[0]  # 24 tokens, no EOS
    assert len(chunks) > 3  # it came in pieces
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24


def test_completions_take_raw_text(srv):
    status, r = post(srv, "/v1/completions", {"prompt": "w5 w9 w17", "temperature": 0, "max_tokens": 16})
    assert status == 200, r
    assert r["object"] == "text_completion"
    assert r["choices"][0]["text"] == vanilla(srv, srv.tok("w5 w9 w17")["input_ids"], 16)[0]
    streamed = post_stream(srv, "/v1/completions", {"prompt": ["w5 w9 w17"], "temperature": 0, "max_tokens": 16})
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == r["choices"][0]["text"]


def test_stop_strings_cut_the_text(srv):
    full, ids, _ = vanilla(srv, srv.tok("w5 w9 w17")["input_ids"], 40)
    words = full.split()
    stop = " " + words[len(words) // 2]  # spans two tokens' text: the space and the word
    want = full[:full.find(stop)]
    # what vanilla decoding with this stop string would have generated: up to the stop string's end
    used = next(n for n in range(1, len(ids) + 1) if stop in srv.tok.decode(ids[:n], skip_special_tokens=True))
    body = {"prompt": "w5 w9 w17", "temperature": 0, "max_tokens": 40, "stop": ["never there", stop]}
    status, r = post(srv, "/v1/completions", body)
    assert status == 200, r
    assert r["choices"][0] == {"index": 0, "text": want, "finish_reason": "stop", "logprobs": None}
    assert r["usage"]["completion_tokens"] == used
    streamed = post_stream(srv, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in streamed[:-1]) == want
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"


def test_usage_counts_no_token_past_a_stop_string(srv, monkeypatch):
    from eaglespec import server

    """A round may accept tokens past the stop string; usage counts what vanilla decoding would have."""
    full, ids, _ = vanilla(srv, srv.tok("w5 w9 w17")["input_ids"], 40)
    stop = " " + full.split()[3]
    used = next(n for n in range(1, len(ids) + 1) if stop in srv.tok.decode(ids[:n], skip_special_tokens=True))
    assert used < len(ids)

    def one_round(job, alive):
        job.stats.new_tokens = len(ids)  # every token in one round, as a long accepted path would give
        yield list(ids), "length"

    monkeypatch.setattr(server.Job, "tokens", one_round)
    status, r = post(srv, "/v1/completions", {"prompt": "w5 w9 w17", "temperature": 0, "max_tokens": 40, "stop": stop})
    assert status == 200 and r["choices"][0]["text"] == full[:full.find(stop)]
    assert r["usage"]["completion_tokens"] == used


def test_sampling_follows_the_seed_and_the_parameters(srv):
    body = {"prompt": "w30 w31 w32", "temperature": 0.9, "top_p": 0.8, "seed": 7, "max_tokens": 30}
    texts = [post(srv, "/v1/completions", body)[1]["choices"][0]["text"] for _ in range(2)]
    assert texts[0] == texts[1]
    ids = srv.tok("w30 w31 w32")["input_ids"]
    out = srv.engine.generate(ids, 30, SamplingParams(0.9, 0.8), "eagle", 7, srv.eos)
    assert texts[0] == srv.tok.decode(out.token_ids, skip_special_tokens=True)
    other = post(srv, "/v1/completions", {**body, "seed": 8})[1]["choices"][0]["text"]
    assert other != texts[0]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "w5"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "w5"}, 400, "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["w5", "w6"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "w5", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w5", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w5", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "w5", "top_k": -1}, 400, "top_k"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w5", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w5", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "w5", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "w5", "logprobs": 3}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "w5", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": " ".join(["w3"] * 600)}, 400, None),  # longer than the context
    ("/v1/completions", {"prompt": "w5", "model": "gpt-4o"}, 404, "model"),
    ("/v1/embeddings", {"input": "w5"}, 404, None),
    ("/v1/completions", [1, 2], 400, None),
])
def test_bad_requests_get_openai_errors(srv, path, body, status, param):
    code, r = post(srv, path, body)
    assert code == status, r
    assert set(r) == {"error"} and r["error"]["param"] == param and r["error"]["message"]


def test_bad_json_and_other_endpoints(srv):
    code, r = post(srv, "/v1/completions", None, raw=b"{not json")
    assert code == 400 and "not valid JSON" in r["error"]["message"]
    with urllib.request.urlopen(srv.url + "/v1/models") as resp:
        assert json.loads(resp.read())["data"][0]["id"] == "tiny"
    with urllib.request.urlopen(srv.url + "/health") as resp:
        assert json.loads(resp.read()) == {"status": "ok", "running": 0, "waiting": 0}
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(srv.url + "/v2/nothing")
    assert e.value.code == 404


def test_one_connection_serves_requests_after_an_error(srv):
    """Keep-alive: a refused request's body is read all the same, so the next request on the same
    connection is parsed from its own first byte."""
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    for path, body, status in (("/v1/embeddings", {"input": "w5 " * 50}, 404),
                               ("/v1/completions", {"prompt": "w5", "n": 3}, 400),
                               ("/v1/completions", {"prompt": "w5 w9 w17", "temperature": 0, "max_tokens": 4}, 200)):
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == status and json.loads(resp.read())
    conn.close()


def test_requests_side_by_side_get_their_own_answers(srv):
    prompts = ["w5 w9", "w30 w31 w32", "w7", "w100 w101"]
    want = [vanilla(srv, srv.tok(p)["input_ids"], 20)[0] for p in prompts]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        got[i] = post(srv, "/v1/completions", {"prompt": prompts[i], "temperature": 0, "max_tokens": 20})[1][
            "choices"][0]["text"]
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got.get(i) for i in range(len(prompts))] == want


def test_a_client_that_leaves_mid_stream_frees_the_engine(srv):
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "w30 w31 w32", "max_tokens": 400, "stream": True,
                                                        "temperature": 1, "seed": 1}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    conn.close()
    status, r = post(srv, "/v1/completions", {"prompt": "w5 w9", "temperature": 0, "max_tokens": 8})
    assert status == 200 and r["choices"][0]["text"] == vanilla(srv, srv.tok("w5 w9")["input_ids"], 8)[0]


def raw_request(s, head: bytes, body: bytes = b"", shut: bool = True) -> tuple[int, dict]:
    """A hand-written HTTP request (headers `head`, then `body`), the write side closed after it."""
    import socket

    host, port = s.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(head + b"\r\n" + body)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_malformed_http_is_answered_and_the_server_stays_up(srv):
    """Every malformed request gets OpenAI's error object and a status, never a dropped connection."""
    good = b'{"prompt": "w5", "max_tokens": 2}'
    for head, body, status, words in (
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n", good, 411, "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: -5\r\n", good, 411,
         "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: lots\r\n", good, 411,
         "Content-Length"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 500\r\n", good, 400,
         "ended after"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % len(good), good,
         415, "application/json"),
        (b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n" % len(good), good, 415, "application/json"),
    ):
        code, r = raw_request(srv, head, body)
        assert code == status and words in r["error"]["message"], (head, r)
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw, words in ((deep, "nested too deeply"), (b'{"prompt": "w5 \\ud800"}', "not valid Unicode")):
        code, r = post(srv, "/v1/completions", None, raw=raw)
        assert code == 400 and words in r["error"]["message"], r
    code, r = post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 10**9})
    assert code == 400 and r["error"]["param"] == "max_tokens" and "this server's limit" in r["error"]["message"]
    code, r = post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 2, "temperature": 1, "seed": 2**70})
    assert code == 400 and "seed" in r["error"]["message"]
    code, r = post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 2, "temperature": 1e-40})
    assert code == 400 and r["error"]["param"] == "temperature"
    assert post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 2})[0] == 200


def test_a_failure_of_ours_is_a_500_and_the_server_goes_on(srv, monkeypatch):
    from eaglespec import server

    def broken(self):
        yield "w"
        raise RuntimeError("boom")

    monkeypatch.setattr(server.Completion, "pieces", broken)
    code, r = post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 4})
    assert code == 500 and r["error"]["type"] == "server_error" and "RuntimeError" in r["error"]["message"]
    events = post_stream(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 4})
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"  # an error event, then [DONE]
    monkeypatch.undo()
    assert post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 2})[0] == 200


def test_a_failure_in_the_decode_thread_is_a_500_and_decoding_goes_on(srv, monkeypatch):
    """The decode thread's round raises: every request in that batch gets a 500 (a stream: an error
    event, then [DONE]), and the next requests decode as ever."""
    from eaglespec.spec.engine import ContinuousBatch

    step, calls = ContinuousBatch.step, []

    def flaky(cb):
        if cb.eos == []:  # the server below (the module's server may still finish a request of its own)
            calls.append(1)
            if len(calls) in (2, 4):  # a round after the prefill, in each of the two requests below
                raise RuntimeError("boom")
        return step(cb)

    monkeypatch.setattr(ContinuousBatch, "step", flaky)
    endless = serve(srv.engine, srv.tok, "tiny", [], port=0, warm_up=False)  # no end token: several rounds
    threading.Thread(target=endless.serve_forever, daemon=True).start()
    try:
        body = {"prompt": "w5 w9", "max_tokens": 40, "temperature": 0}
        code, r = post(endless, "/v1/completions", body)
        assert code == 500 and "RuntimeError" in r["error"]["message"]
        events = post_stream(endless, "/v1/completions", body)
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        code, r = post(endless, "/v1/completions", body)
        ids = Engine(srv.engine.model).generate(srv.tok("w5 w9")["input_ids"], 40, method="vanilla").token_ids
        assert code == 200 and r["choices"][0]["text"] == srv.tok.decode(ids, skip_special_tokens=True)
        assert len(calls) > 4 and endless.scheduler.load() == {"running": 0, "waiting": 0}
    finally:
        endless.shutdown()
        endless.server_close()


def test_api_key_and_the_warning_beyond_loopback(srv, capsys):
    keyed = serve(srv.engine, srv.tok, "tiny", srv.eos, port=0, warm_up=False, api_key="s3cret")
    threading.Thread(target=keyed.serve_forever, daemon=True).start()
    try:
        body = json.dumps({"prompt": "w5", "max_tokens": 2}).encode()
        for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                ({"Authorization": "Bearer s3cret"}, 200)):
            req = urllib.request.Request(keyed.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            assert code == status
        with urllib.request.urlopen(keyed.url + "/health") as r:  # health checks need no key
            assert r.status == 200
    finally:
        keyed.shutdown()
        keyed.server_close()
    capsys.readouterr()
    for host, key, warned in (("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)):
        s = serve(srv.engine, srv.tok, "tiny", srv.eos, host=host, port=0, warm_up=False, api_key=key)
        s.server_close()
        assert ("without --api-key" in capsys.readouterr().err) == warned


class BytesTok:
    """A tokenizer whose tokens are raw bytes, to split characters and stop strings across tokens."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_text_stream_waits_for_whole_characters_and_stop_strings():
    tok = BytesTok([b"ab", b"c<", b"/s", b">d", "é".encode()[:1], "é".encode()[1:], b"<x"])
    t = TextStream(tok, stop=["</s>"])
    assert [t.push([i]) for i in (0, 1, 2)] == ["ab", "c", ""]  # "<" and "</s" might begin the stop string
    assert t.push([3]) == "" and t.stopped and t.text == "abc"
    assert t.push([4]) == "" and t.finish() == ""  # after the stop nothing more comes
    assert t.used == 4  # the tokens up to the stop string's end
    t = TextStream(tok, stop=["</s>"])
    assert t.push([0, 1, 2, 3, 4, 5]) == "abc" and t.used == 4  # one round past the stop string
    t = TextStream(tok, stop=["</s>"])
    assert t.push([1]) == "c"
    assert t.push([6]) == "<<x"  # a false alarm is released once the text moves on
    assert t.push([0]) == "ab" and t.finish() == ""
    t = TextStream(tok)
    assert t.push([4]) == "" and t.push([5]) == "é"  # half a character is held back
    assert t.push([4]) == "" and t.finish() == "\ufffd"  # ... until the end


class CleanUpTok(BytesTok):
    """transformers' space clean-up on top (what a tokenizer with clean_up_tokenization_spaces does)."""

    clean_up_tokenization_spaces = True

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        from transformers import PreTrainedTokenizerBase

        return PreTrainedTokenizerBase.clean_up_tokenization(super().decode(ids, skip_special_tokens))


def test_text_stream_pieces_join_to_the_whole_decoding_under_space_clean_up():
    """A token can make the clean-up rewrite text decoded before it (" '" + "s" -> "'s"): streamed one
    token at a time or in rounds, the pieces join to the decoding of all the tokens."""
    import random

    pieces = [b"x", b" ", b"'", b"s", b" ,", b",", b" n", b"'t", b" .", b"''", b" '", b"a", b"?", b"ve"]
    tok, rng = CleanUpTok(pieces), random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(1, 12))]
        t, out, i = TextStream(tok), "", 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out += t.push(ids[i:i + n])
            i += n
        assert out + t.finish() == tok.decode(ids), ids


# -- the official client, concurrency, the queue, faults -------------------------------------------
def test_the_official_openai_client(srv):
    """Chat, completions, streaming and errors through `openai.OpenAI`, as users call it."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    want, ids, _ = vanilla(srv, chat_ids(srv, "w5 w9 w17"), 16)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w17"}],
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content == want and r.usage.completion_tokens == len(ids)
    parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w17"}],
                                           max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(parts)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(ids)
    c = client.completions.create(model="tiny", prompt="w30 w31", max_tokens=8, temperature=0)
    assert c.choices[0].text == vanilla(srv, srv.tok("w30 w31")["input_ids"], 8)[0]
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="w5", max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w5", max_tokens=4)


class Paused:
    """Holds the scheduler's decode thread before each round until released (to fill its queue)."""

    def __init__(self, monkeypatch) -> None:
        from eaglespec.spec.engine import ContinuousBatch

        self.go, self.sizes = threading.Event(), []
        step = ContinuousBatch.step

        def held(cb):
            self.sizes.append(len(cb))
            self.go.wait(60)
            return step(cb)

        monkeypatch.setattr(ContinuousBatch, "step", held)


def wait_for(cond, timeout: float = 30.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_a_full_queue_answers_503_with_retry_after_and_order_is_kept(srv, monkeypatch):
    paused = Paused(monkeypatch)
    small = serve(srv.engine, srv.tok, "tiny", srv.eos, port=0, warm_up=False, max_batch=1, max_queue=2)
    threading.Thread(target=small.serve_forever, daemon=True).start()
    try:
        done: list[int] = []

        def ask(i: int) -> None:
            status, r = post(small, "/v1/completions", {"prompt": f"w{i}", "temperature": 0, "max_tokens": 3})
            assert status == 200
            done.append(i)

        threads = []
        for i in range(3):  # one decoding (held), two waiting
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            wait_for(lambda: sum(small.scheduler.load().values()) == i + 1)
        req = urllib.request.Request(small.url + "/v1/completions", data=b'{"prompt": "w5", "max_tokens": 2}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 503 and int(e.value.headers["Retry-After"]) >= 1
        assert json.loads(e.value.read())["error"]["type"] == "server_error"
        paused.go.set()
        for t in threads:
            t.join(60)
        assert done == [0, 1, 2]  # first come, first served
    finally:
        paused.go.set()
        small.shutdown()
        small.server_close()


def test_a_client_that_leaves_cancels_its_request_streamed_or_not(srv, monkeypatch):
    import socket

    paused = Paused(monkeypatch)
    endless = serve(srv.engine, srv.tok, "tiny", [], port=0, warm_up=False)  # no end token: 400 tokens to go
    threading.Thread(target=endless.serve_forever, daemon=True).start()
    host, port = endless.server_address[:2]
    for stream in (False, True):
        paused.sizes.clear()
        paused.go.clear()
        body = json.dumps({"prompt": "w30 w31", "max_tokens": 400, "temperature": 0, "stream": stream}).encode()
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_for(lambda: endless.scheduler.load()["running"] == 1)
        paused.go.set()  # the client has gone: the job ends within a poll, not after 400 tokens
        wait_for(lambda: endless.scheduler.load() == {"running": 0, "waiting": 0}, 10)
        assert len(paused.sizes) < 20  # rounds run: 400 tokens would take 80 or more
    monkeypatch.undo()
    endless.shutdown()
    endless.server_close()
    assert post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 2})[0] == 200


def test_request_body_fuzz_gets_answers_never_a_drop(srv):
    """Seeded random mutations of valid bodies: every one gets a status and JSON (a 200 or OpenAI's
    error object, never a 5xx), and the server is healthy after."""
    import random

    rng = random.Random(1234)
    values = [None, True, -1, 0, 1, 2.5, 1e308, -1e308, 2**64, "", "w5", "\ud800", [], [1], {}, {"a": 1},
              ["w5"], [{"role": "user", "content": "w5"}], "x" * 5000]
    keys = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n",
            "model", "stream_options", "max_completion_tokens", "logprobs", "role", "content"]
    base = {"/v1/completions": {"prompt": "w5 w9", "max_tokens": 3},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 3}}
    for i in range(120):
        path = rng.choice(list(base))
        body = json.loads(json.dumps(base[path]))
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(keys)
            if rng.random() < 0.2:
                body.pop(key, None)
            elif key in ("role", "content") and "messages" in body and isinstance(body["messages"], list) \
                    and body["messages"] and isinstance(body["messages"][0], dict):
                body["messages"][0][key] = rng.choice(values)
            else:
                body[key] = rng.choice(values)
        raw = json.dumps(body).encode()
        if rng.random() < 0.15:  # damaged JSON too
            cut = rng.randrange(len(raw))
            raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
        body_stream = isinstance(body, dict) and body.get("stream") is True
        req = urllib.request.Request(srv.url + path, data=raw, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, data = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, data = e.code, e.read()
        assert status < 500, (i, raw[:200], data[:200])
        if status == 200 and body_stream:
            assert data.rstrip().endswith(b"data: [DONE]")
        else:
            parsed = json.loads(data)
            assert ("choices" in parsed) == (status == 200), (raw[:200], parsed)
    assert post(srv, "/v1/completions", {"prompt": "w5", "max_tokens": 2})[0] == 200


def test_load_and_faults(srv, monkeypatch):
    """16 clients x 3 requests at once, streamed and not, greedy and sampled, some leaving mid-stream,
    one reading slowly, a few malformed: every finished answer equals its vanilla decoding, no 5xx,
    requests really shared rounds, and the server is healthy after."""
    import random
    import socket
    import time

    from eaglespec.spec.engine import ContinuousBatch

    sizes: list[int] = []
    step = ContinuousBatch.step
    monkeypatch.setattr(ContinuousBatch, "step", lambda cb: sizes.append(len(cb)) or step(cb))
    prompts = [f"w{3 + i} w{40 + 2 * i} w{90 - i}" for i in range(8)]
    want = {p: vanilla(srv, srv.tok(p)["input_ids"], 24) for p in prompts}
    failures: list[str] = []
    host, port = srv.server_address[:2]

    def client(c: int) -> None:
        rng = random.Random(c)
        for k in range(3):
            p = rng.choice(prompts)
            kind = ("leave" if c % 5 == 0 and k == 1 else "slow" if c == 1 and k == 0 else
                    "malformed" if c % 7 == 3 and k == 2 else rng.choice(["plain", "stream", "sampled"]))
            body = {"prompt": p, "max_tokens": 24, "temperature": 0}
            try:
                if kind == "malformed":
                    status, r = post(srv, "/v1/completions", None, raw=b'{"prompt": "w5", "max_tokens": }')
                    assert status == 400, r
                elif kind == "sampled":
                    status, r = post(srv, "/v1/completions", {**body, "temperature": 0.8})
                    assert status == 200 and r["usage"]["completion_tokens"] <= 24
                elif kind == "plain":
                    status, r = post(srv, "/v1/completions", body)
                    assert status == 200 and r["choices"][0]["text"] == want[p][0], (p, r)
                elif kind == "stream":
                    events = post_stream(srv, "/v1/completions", body)
                    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == want[p][0]
                else:  # leave mid-stream, or read one event a while
                    with socket.create_connection((host, port), timeout=60) as sock:
                        data = json.dumps({**body, "stream": True, "max_tokens": 200}).encode()
                        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
                        first = sock.recv(64)
                        assert first.startswith(b"HTTP/1.1 200"), first
                        if kind == "slow":
                            got = first
                            while not got.rstrip().endswith(b"data: [DONE]"):
                                time.sleep(0.05)
                                chunk = sock.recv(256)
                                assert chunk, "the stream ended early"
                                got += chunk
            except Exception as e:  # noqa: BLE001
                failures.append(f"client {c} request {k} ({kind}): {type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "clients still waiting"
    assert not failures, failures
    assert time.monotonic() - t0 < 240
    assert max(sizes) > 1  # requests decoded together
    wait_for(lambda: srv.scheduler.load() == {"running": 0, "waiting": 0}, 30)
    with urllib.request.urlopen(srv.url + "/health") as r:
        assert json.loads(r.read())["status"] == "ok"
