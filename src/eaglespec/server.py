"""``eaglespec serve``: an OpenAI-compatible HTTP server over one `Engine`.

    GET  /v1/models             the one model served
    GET  /health                {"status": "ok"}
    POST /v1/chat/completions   messages -> the target's chat template -> EAGLE decoding
    POST /v1/completions        a raw text prompt (no template)

``"stream": true`` answers with server-sent events (``data: {chunk}`` ... ``data: [DONE]``), as
OpenAI's clients expect. Output is the target's own (EAGLE is lossless), so a client cannot tell
the server from plain decoding except by its speed; each response also carries an ``eaglespec``
object with the round statistics (tau, tokens/s).

Requests that arrive together decode together (`scheduler.Scheduler`: continuous batching, each
round one target forward for every running request); the decode thread hands tokens to each request's
own queue, and the request's handler thread writes them, so a slow or departed client holds up
nobody. A client that leaves (streamed or not) cancels its request. A full queue answers 503 with
``Retry-After``. Stdlib only (`http.server`).

Every answer is JSON or a server-sent event stream, errors included (OpenAI's error object; 500 for
a failure of ours, and in a stream an error event, then ``[DONE]``). Requests must say
``Content-Type: application/json`` (so a web page cannot post to it without a CORS preflight,
which this server does not grant), carry a body within `MAX_BODY` and, with ``--api-key``, the key as
a Bearer token; a client that sends or reads nothing for `SOCKET_TIMEOUT_S` is dropped.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator

from transformers import PreTrainedTokenizerBase

from .errors import EaglespecError
from .models import Engine
from .scheduler import Job, QueueFull, Scheduler, ServerClosing
from .spec import ContinuousBatch
from .spec.verify import SamplingParams
from .text import TextStream

MAX_BODY = 4 << 20  # bytes
SOCKET_TIMEOUT_S = 60  # a client silent this long (not sending its body, not reading its answer) is dropped
MAX_STOP = 4  # OpenAI's limit on stop strings
FINISH = {"eos": "stop", "length": "length", "context": "length"}  # engine reason -> OpenAI's


class RequestError(EaglespecError):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.headers = param, status, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Request:
    """A validated completion request."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _number(body: dict, name: str, default: float, kind: type = float) -> Any:
    val = body.get(name)
    if val is None:
        return default
    ok = isinstance(val, int) if kind is int else isinstance(val, (int, float))
    if isinstance(val, bool) or not ok:
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {val!r}", name)
    return val


def _message_text(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
        raise RequestError(f"messages[{i}] must be an object with role system, user or assistant", "messages")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string", "messages")
    role = "system" if m["role"] == "developer" else m["role"]
    return {"role": role, "content": content}


def _check_text(texts: list[str], param: str) -> None:
    """Text a tokenizer can take: valid Unicode (JSON can carry lone surrogates, which it cannot)."""
    for t in texts:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("the text is not valid Unicode (a lone surrogate)", param) from None


def parse_request(body: Any, tok: PreTrainedTokenizerBase, chat: bool, default_max_tokens: int,
                  max_tokens_limit: int = 1 << 20) -> Request:
    """Validate an OpenAI request body and tokenize its prompt; `RequestError` names the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, neutral in (("n", 1), ("best_of", 1), ("presence_penalty", 0), ("frequency_penalty", 0)):
        if body.get(name, neutral) not in (None, neutral):
            raise RequestError(f"{name} is not supported (only {neutral}): it would change the target's output", name)
    if body.get("logprobs") or body.get("top_logprobs") or body.get("logit_bias") or body.get("echo") \
            or body.get("suffix") or body.get("tools") or body.get("response_format"):
        bad = next(k for k in ("logprobs", "top_logprobs", "logit_bias", "echo", "suffix", "tools", "response_format")
                   if body.get(k))
        raise RequestError(f"{bad} is not supported", bad)
    max_tokens = _number(body, "max_completion_tokens", None, int) if chat else None
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", default_max_tokens, int)
    if max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > max_tokens_limit:
        raise RequestError(f"max_tokens must be <= {max_tokens_limit} (this server's limit), got {max_tokens}",
                           "max_tokens")
    temperature = _number(body, "temperature", 1.0)  # OpenAI's default
    top_p = _number(body, "top_p", 1.0)
    top_k = _number(body, "top_k", 0, int)  # not OpenAI's, but vLLM's and llama.cpp's
    try:
        sampling = SamplingParams(float(temperature), float(top_p), top_k)
    except ValueError as e:
        raise RequestError(str(e), next(n for n in ("temperature", "top_p", "top_k") if n in str(e))) from None
    seed = _number(body, "seed", None, int)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP):
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("messages must be a non-empty list", "messages")
        msgs = [_message_text(m, i) for i, m in enumerate(msgs)]
        if not any(m["content"].strip() for m in msgs):
            raise RequestError("every message is empty", "messages")
        if tok.chat_template is None:
            raise RequestError("this model has no chat template: use /v1/completions", "messages")
        _check_text([m["content"] for m in msgs], "messages")
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (one prompt per request)", "prompt")
        if not prompt.strip():
            raise RequestError("empty prompt", "prompt")
        _check_text([prompt], "prompt")
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
    return Request(ids, max_tokens, sampling, seed, stop, stream, include_usage)


class Completion:
    """One request's decode (a `Job` on the scheduler), turned into OpenAI's response objects."""

    def __init__(self, server: "EagleServer", req: Request, chat: bool, job: Job,
                 alive: Callable[[], bool] = lambda: True) -> None:
        self.server, self.req, self.chat, self.job = server, req, chat, job
        self.alive = alive  # whether the client is still there (see `Job.tokens`)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.stats = job.stats
        self.finish_reason = "length"
        self.text: TextStream | None = None

    def pieces(self) -> Iterator[str]:
        """The completion's text, piece by piece as the scheduler sends tokens; the job is cancelled
        when the text stops early, the client leaves, or anything fails."""
        s, req = self.server, self.req
        text = self.text = TextStream(s.tok, req.stop)
        try:
            for new, reason in self.job.tokens(self.alive):
                self.finish_reason = FINISH[reason or "length"]
                with s.tok_lock:
                    piece = text.push(new)
                if text.stopped:
                    self.finish_reason = "stop"
                    yield piece
                    return
                if piece:
                    yield piece
            with s.tok_lock:
                tail = text.finish()
            yield tail
        except ServerClosing as e:
            raise RequestError(str(e), status=503, kind="server_error") from None
        except EaglespecError as e:  # do_POST checked the request; anything the engine still refuses
            raise RequestError(str(e), "messages" if self.chat else "prompt") from None
        finally:
            self.job.cancel()

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.model_id}

    def usage(self) -> dict:
        n, m = len(self.req.prompt_ids), self.stats.new_tokens
        if self.text is not None and self.text.stopped:
            m = self.text.used  # not the tokens a round accepted past the stop string
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def extras(self) -> dict:
        st = self.stats
        return {"method": self.server.method, "tau": round(st.tau, 3), "rounds": st.rounds,
                "tokens_per_s": round(st.tokens_per_s, 1)}

    def response(self, text: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": self.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
        return {**self._base("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": self.usage(), "eaglespec": self.extras()}

    def chunk(self, piece: str | None, finish: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {} if piece is None else {"content": piece}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        return {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def chunks(self) -> Iterator[dict]:
        if self.chat:
            yield self.chunk("", first=True)
        for piece in self.pieces():
            if piece:
                yield self.chunk(piece)
        yield {**self.chunk(None, self.finish_reason), "eaglespec": self.extras()}
        if self.req.include_usage:
            yield {**self._base(self.chunk(None)["object"]), "choices": [], "usage": self.usage()}


class EagleServer(ThreadingHTTPServer):
    """The HTTP server: one engine, one tokenizer, one decode thread (`Scheduler`)."""

    daemon_threads = True
    # connections waiting to be accepted: socketserver's 5 overflows when many clients connect at once
    # on a busy machine, and the kernel then resets some of them
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], engine: Engine, tok: PreTrainedTokenizerBase, model_id: str,
                 eos: list[int], method: str = "eagle", default_max_tokens: int = 1024,
                 api_key: str | None = None, batch: Engine | None = None, max_batch: int = 8,
                 max_queue: int = 64, log_requests: bool = True) -> None:
        super().__init__(address, Handler)
        self.log_requests = log_requests
        self.engine, self.tok, self.model_id, self.eos = engine, tok, model_id, eos
        self.method, self.default_max_tokens, self.api_key = method, default_max_tokens, api_key
        self.max_tokens_limit = engine.max_context  # no answer can be longer than the context
        # a fast tokenizer used from two threads at once can fail ("Already borrowed")
        self.tok_lock = threading.Lock()
        self.scheduler = Scheduler(engine, method, eos, batch, max_batch, max_queue)

    def server_close(self) -> None:
        super().server_close()
        scheduler = getattr(self, "scheduler", None)  # None: the address could not be bound
        if scheduler is not None:
            scheduler.close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class Handler(BaseHTTPRequestHandler):
    server: EagleServer
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S  # on every read and write of this connection

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.server.log_requests:
            super().log_request(code, size)

    def _authorised(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization") or ""
        return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())

    def handle_one_request(self) -> None:
        """A dropped or silent client ends its own connection, never the server; a failure of ours
        still answers (500, OpenAI's error object) where nothing was sent yet."""
        try:
            super().handle_one_request()
        except (TimeoutError, ConnectionError):
            self.close_connection = True

    def _send_json(self, obj: dict, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, e: RequestError) -> None:
        self._send_json(e.body(), e.status, e.headers)

    def _client_alive(self) -> bool:
        """False once the client closed its side of the connection (it left)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return not readable or self.connection.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path != "/health" and not self._authorised():
            return self._fail(RequestError("a valid API key is needed (Authorization: Bearer KEY)", status=401,
                                           kind="authentication_error"))
        if path == "/health":
            self._send_json({"status": "ok", **self.server.scheduler.load()})
        elif path == "/v1/models":
            self._send_json({"object": "list", "data": [
                {"id": self.server.model_id, "object": "model", "created": 0, "owned_by": "eaglespec"}]})
        else:
            self._fail(RequestError(f"no such endpoint: GET {path}", status=404, kind="not_found_error"))

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        sent = False
        try:
            length = self.headers.get("Content-Length")
            if length is None or not length.strip().isdigit():
                self.close_connection = True  # where the body ends is unknown
                raise RequestError("a Content-Length header (a whole number of bytes) is needed", status=411)
            size = int(length)
            if size > MAX_BODY:
                self.close_connection = True  # the unread body must not be taken for the next request
                raise RequestError(f"request body over {MAX_BODY} bytes", status=413)
            raw = self.rfile.read(size)
            if len(raw) < size:
                self.close_connection = True
                raise RequestError(f"the body ended after {len(raw)} of its {size} bytes")
            if not self._authorised():
                raise RequestError("a valid API key is needed (Authorization: Bearer KEY)", status=401,
                                   kind="authentication_error")
            kind = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise RequestError(f"Content-Type must be application/json, got {kind or 'none'!r}", status=415)
            if path not in ("/v1/chat/completions", "/v1/completions"):
                raise RequestError(f"no such endpoint: POST {path}", status=404, kind="not_found_error")
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"the request body is not valid JSON ({e})") from None
            except RecursionError:
                raise RequestError("the request body is nested too deeply") from None
            model = body.get("model") if isinstance(body, dict) else None
            if model not in (None, self.server.model_id):
                raise RequestError(f"model {model!r} is not served here; this server serves "
                                   f"{self.server.model_id!r}", "model", 404, "not_found_error")
            chat = path == "/v1/chat/completions"
            with self.server.tok_lock:
                req = parse_request(body, self.server.tok, chat, self.server.default_max_tokens,
                                    self.server.max_tokens_limit)
            self.server.engine.check_request(req.prompt_ids, req.max_tokens, self.server.method)
            try:
                job = self.server.scheduler.submit(req.prompt_ids, req.max_tokens, req.sampling, req.seed)
            except QueueFull as e:
                raise RequestError(str(e), status=503, kind="server_error",
                                   headers={"Retry-After": str(e.retry_after)}) from None
            except ServerClosing as e:
                raise RequestError(str(e), status=503, kind="server_error") from None
            done = Completion(self.server, req, chat, job, self._client_alive)
            if req.stream:
                sent = True  # the stream's headers go out first; its errors go in the stream
                return self._stream(done)
            text = "".join(done.pieces())
            if not self._client_alive():
                self.close_connection = True
                return  # nobody to answer
            sent = True
            self._send_json(done.response(text))
        except RequestError as e:
            self._fail(e)
        except EaglespecError as e:
            self._fail(RequestError(str(e)))
        except (TimeoutError, ConnectionError):
            self.close_connection = True  # the client is gone or silent: nobody to answer
        except Exception as e:  # noqa: BLE001 (a failure of ours: answered, logged, and the server goes on)
            self.log_error("internal error on %s: %s: %s", path, type(e).__name__, e)
            if not sent:
                self._fail(RequestError(f"internal error: {type(e).__name__}", status=500, kind="server_error"))

    def _stream(self, done: Completion) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends when the connection does
        self.end_headers()
        self.close_connection = True
        events = done.chunks()
        try:
            for obj in events:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except RequestError as e:  # found once decoding began: reported in the stream
            self._end_stream(e)
        except (TimeoutError, ConnectionError):
            events.close()  # the client left or stopped reading: its job is cancelled
        except Exception as e:  # noqa: BLE001 (a failure of ours mid-stream: an error event, then [DONE])
            self.log_error("internal error in a stream: %s: %s", type(e).__name__, e)
            events.close()
            self._end_stream(RequestError(f"internal error: {type(e).__name__}", status=500, kind="server_error"))

    def _end_stream(self, e: RequestError) -> None:
        try:
            self.wfile.write(b"data: " + json.dumps(e.body()).encode() + b"\n\ndata: [DONE]\n\n")
        except (TimeoutError, ConnectionError):
            pass


def serve(engine: Engine, tok: PreTrainedTokenizerBase, model_id: str, eos: list[int], host: str = "127.0.0.1",
          port: int = 8000, method: str = "eagle", default_max_tokens: int = 1024, warm_up: bool = True,
          api_key: str | None = None, batch_tree: str | None = "chain:1", max_batch: int = 8,
          max_queue: int = 64, log_requests: bool = True) -> EagleServer:
    """An `EagleServer` bound to host:port (port 0: any free one), not yet serving: call
    ``serve_forever()`` on it (in a thread, for tests) and ``shutdown()`` then ``server_close()`` to
    stop. Up to `max_batch` requests decode together, drafting `batch_tree` (a static tree; None:
    plain batched steps) while several run; `max_queue` more may wait. `warm_up` decodes a few
    tokens first, so that the first client does not wait for `--tree auto`'s cost curve (measured
    once per machine) or for the kernels' first calls. `log_requests`: one line per request on stderr."""
    if default_max_tokens > engine.max_context:
        default_max_tokens = engine.max_context
    batch = None
    if batch_tree is not None and method == "eagle":
        batch = engine.with_tree(batch_tree)
        ContinuousBatch.check_batch_engine(engine, batch)  # now, not at the first request
    srv = EagleServer((host, port), engine, tok, model_id, eos, method, default_max_tokens, api_key, batch,
                      max_batch, max_queue, log_requests)
    if warm_up:  # before serve_forever: no request can reach the engine yet
        engine.generate(tok("Hello")["input_ids"] or [0], 4, SamplingParams(), method, eos_token_ids=eos)
    if api_key is None and not _loopback(host):
        print(f"eaglespec: warning: serving on {host} without --api-key: anyone who reaches this address can "
              "use the model", file=sys.stderr)
    return srv


def _loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
