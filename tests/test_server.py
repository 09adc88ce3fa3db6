"""The real server in a subprocess on a free loopback port, driven with the ``openai`` client:
streamed = non-streamed, batch-invariant greedy output = generate's while other requests run,
64 concurrent requests, and faults (bad requests, a client that goes away, overload, SIGTERM).
Every loop here is bounded and every request targets 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from specdraft.api import build_engine  # noqa: E402
from specdraft.bench.serve import ServerProcess, free_port, scrape  # noqa: E402
from specdraft.model.loader import load  # noqa: E402
from specdraft.sampling import Sampling  # noqa: E402
from specdraft.sequence import GenerationConfig  # noqa: E402
from tiny_models import write_hf_model  # noqa: E402

HOST = "127.0.0.1"
MODEL_ID = "tiny"
PROMPTS = ["Hello there, how are", "The quick brown fox", "def add(a, b):\n    return", "Once upon a time",
           "She sells sea shells by", "for i in range(10):", "Numbers like 12345 and", "It was the best of"]


class Server(ServerProcess):
    """``specdraft serve`` in a subprocess (bench-serve's ``ServerProcess``: up once /health
    answers; stopped with SIGTERM, killed if it hangs), with the tests' helpers."""

    def __init__(self, model: Path, *args: str) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "specdraft", "serve", "--model", str(model), "--port", str(port),
               "--host", HOST, "--served-model-name", MODEL_ID, "--threads", "1", *args]
        super().__init__(cmd, port, f"test-{port}", model.parent)

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        return scrape(self.url)

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory) -> Path:
    """The tiny random Llama with a 4096-token context (long requests for the fault tests)."""
    return write_hf_model(tmp_path_factory.mktemp("serve") / "tiny-long", "llama", seed=0, max_position=4096)


@pytest.fixture(scope="module")
def server(tiny_long: Path) -> Iterator[Server]:
    s = Server(tiny_long, "--method", "ngram", "--batch-invariant", "--max-batch", "64", "--max-queue", "128",
               "--context", "4096", "--allow-reset")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_long: Path):
    """What ``specdraft generate`` computes: plain decoding, batch-invariant, one prompt at a time."""
    loaded = load(tiny_long, batch_invariant=True)
    engine = build_engine(loaded, "plain")

    def generate(prompt: str, max_tokens: int, **sampling) -> str:
        ids = loaded.tokenizer.encode(prompt)
        return engine.generate([ids], GenerationConfig(max_new_tokens=max_tokens, ignore_eos=True),
                               Sampling(**sampling))[0].text
    return generate


def complete(client, prompt: str, max_tokens: int, stream: bool = False, body: dict | None = None,
             **kw) -> tuple[str, str]:
    """(text, finish_reason) of one completion, streamed or not; ``body``: fields the client does
    not know (extensions such as ``top_k``), with ``ignore_eos`` set."""
    extra = {"ignore_eos": True, **(body or {})}
    if not stream:
        r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, extra_body=extra, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    parts, finish = [], None
    for chunk in client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           extra_body=extra, **kw):
        for c in chunk.choices:
            parts.append(c.text)
            finish = c.finish_reason or finish
    return "".join(parts), finish


def test_models_health_and_usage(server: Server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    r = client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.completion_tokens_details.accepted_prediction_tokens >= 0
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_streamed_text_equals_non_streamed(server: Server, temperature: float):
    client = server.client()
    whole = complete(client, PROMPTS[1], 40, temperature=temperature, seed=7)
    streamed = complete(client, PROMPTS[1], 40, stream=True, temperature=temperature, seed=7)
    assert streamed == whole and whole[1] == "length"
    chat = dict(model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=24,
                temperature=temperature, seed=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**chat).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat)
    pieces, usage = [], None
    for chunk in chunks:
        pieces.extend(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == full
    assert usage is not None and usage.completion_tokens == 24


def test_greedy_output_is_generates_while_other_requests_run(server: Server, reference):
    client = server.client()
    expected = reference(PROMPTS[2], 64)
    with ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(complete, client, p, 200, stream=True, temperature=1.0, seed=i)
                 for i, p in enumerate(PROMPTS)]
        time.sleep(0.2)  # the others are running
        mine = [pool.submit(complete, client, PROMPTS[2], 64, temperature=0) for _ in range(3)]
        results = [f.result() for f in mine]
        for f in noise:
            f.result()
    assert all(text == expected for text, _ in results)


def _wide_steps(m: dict[str, float], rows: int) -> float:
    """Decode steps so far that computed more than ``rows`` rows (the batch-size histogram)."""
    return m["specdraft_batch_size_count"] - m[f'specdraft_batch_size_bucket{{le="{float(rows)}"}}']


def test_64_concurrent_requests_complete_intact(server: Server, reference):
    """64 requests at once, streamed and not, of different lengths, decoded together in one batch
    of up to 64 rows (the server's --max-batch): each text is what generate gives its prompt."""
    client = server.client()
    before = server.metrics()
    jobs = [(PROMPTS[i % len(PROMPTS)], 24 + i % 13, i % 2 == 0) for i in range(64)]
    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(complete, client, p, n, stream, temperature=0) for p, n, stream in jobs]
        results = [f.result(timeout=300) for f in futures]
    for (prompt, n, _), (text, finish) in zip(jobs, results):
        assert finish == "length"
        assert text == reference(prompt, n)  # no token lost, repeated or taken from another stream
    assert _wide_steps(server.metrics(), 32) > _wide_steps(before, 32)  # they did run side by side


def test_stop_strings_and_top_k_through_the_server(server: Server, reference):
    """``stop`` ends the text before the stop string's first occurrence (finish_reason "stop"),
    streamed and not; ``top_k`` = 1 at temperature 1 samples the argmax, so it gives greedy's
    text whatever the seed."""
    client = server.client()
    full = reference(PROMPTS[4], 48)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        assert complete(client, PROMPTS[4], 48, stream=stream, temperature=0, stop=[stop]) == (cut, "stop")
    for seed in (1, 2):
        assert complete(client, PROMPTS[4], 48, temperature=1.0, body={"top_k": 1}, seed=seed) == (full, "length")
    sampled = {complete(client, PROMPTS[4], 48, temperature=1.0, seed=seed)[0] for seed in (1, 2)}
    assert sampled != {full}  # without top_k, temperature 1 does sample


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "x", ', None),
    ({"model": MODEL_ID, "prompt": "x", "colour": "blue"}, "colour"),
    ({"model": MODEL_ID, "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL_ID, "prompt": "x", "max_tokens": 10**9}, "max_tokens"),
    ({"model": MODEL_ID, "prompt": "word " * 5000, "max_tokens": 4}, "max_tokens"),
    ({"model": MODEL_ID, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL_ID, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL_ID, "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": MODEL_ID, "prompt": "x", "n": 2}, "n"),
    ({"model": MODEL_ID, "prompt": ""}, "prompt"),
    ({"model": MODEL_ID, "prompt": "x", "temperature": "hot"}, "temperature"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server: Server, body, param):
    status, answer = server.post("/v1/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and "\n" not in error["message"]
    assert error["param"] == param
    status, answer = server.post("/v1/completions", {"model": MODEL_ID, "prompt": "x", "max_tokens": 2})
    assert status == 200 and answer["usage"]["completion_tokens"] <= 2


def test_chat_errors_and_unknown_model(server: Server):
    status, answer = server.post("/v1/chat/completions", {"model": MODEL_ID, "messages": []})
    assert status == 400 and answer["error"]["param"] == "messages"
    status, answer = server.post("/v1/chat/completions", {"model": MODEL_ID, "messages": [{"role": "wizard",
                                                                                          "content": "hi"}]})
    assert status == 400
    status, answer = server.post("/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_reset_memory_needs_the_flag_and_an_idle_server(server: Server, tiny_long: Path):
    assert wait_for(lambda: server.metrics()["specdraft_running_requests"] == 0)
    status, answer = server.post("/reset_memory", b"")
    assert status == 200 and answer == {"reset": True}
    plain = Server(tiny_long, "--context", "256")
    try:
        status, answer = plain.post("/reset_memory", b"")
        assert status == 404 and "--allow-reset" in answer["error"]["message"]
    finally:
        assert plain.stop() == 0


def wait_for(predicate, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_disconnects_frees_its_row(server: Server):
    assert wait_for(lambda: server.metrics()["specdraft_running_requests"] == 0)
    before = server.metrics()
    body = json.dumps({"model": MODEL_ID, "prompt": PROMPTS[0], "max_tokens": 3900, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    with socket.create_connection((HOST, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data:") < 3:
            received += sock.recv(4096)
        assert server.metrics()["specdraft_running_requests"] == 1
    # the socket is closed: the request is cancelled and its row freed, long before its 3,900 tokens
    assert wait_for(lambda: server.metrics()["specdraft_running_requests"] == 0)
    after = server.metrics()
    key = 'specdraft_requests_total{endpoint="completions",outcome="cancelled"}'
    assert after[key] == before.get(key, 0) + 1
    steps = after["specdraft_decode_steps_total"]
    time.sleep(0.5)
    assert server.metrics()["specdraft_decode_steps_total"] == steps  # no step computes it any more
    assert after["specdraft_last_step_rows"] == 0


def test_a_non_streamed_client_that_disconnects_frees_its_row(server: Server):
    """A client waiting for a whole (non-streamed) answer goes away: the server notices while it
    polls (``DISCONNECT_POLL_S``), cancels the request and frees its row, long before its tokens."""
    assert wait_for(lambda: server.metrics()["specdraft_running_requests"] == 0)
    before = server.metrics()
    body = json.dumps({"model": MODEL_ID, "prompt": PROMPTS[5], "max_tokens": 3900, "ignore_eos": True,
                       "temperature": 0}).encode()
    with socket.create_connection((HOST, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: server.metrics()["specdraft_running_requests"] == 1)
    assert wait_for(lambda: server.metrics()["specdraft_running_requests"] == 0)
    after = server.metrics()
    key = 'specdraft_requests_total{endpoint="completions",outcome="cancelled"}'
    assert after[key] == before.get(key, 0) + 1
    emitted = lambda m: sum(v for k, v in m.items() if k.startswith("specdraft_generation_tokens_total"))  # noqa: E731
    generated = emitted(after) - emitted(before)
    assert 0 < generated < 3900


def test_an_overloaded_server_answers_503(tiny_long: Path):
    """Two slots, but room for one request's tokens in flight: one runs, one waits, the rest
    are refused."""
    s = Server(tiny_long, "--max-batch", "2", "--max-tokens-in-flight", "4096", "--max-queue", "1", "--context", "4096")
    try:
        client = s.client()
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(complete, client, PROMPTS[0], 2100, temperature=0) for _ in range(4)]
            assert wait_for(lambda: s.metrics()["specdraft_waiting_requests"] == 1)
            m = s.metrics()
            assert m["specdraft_running_requests"] + m["specdraft_prefilling_requests"] == 1
            assert 2100 < m["specdraft_tokens_in_flight"] <= m["specdraft_max_tokens_in_flight"] == 4096
            outcomes = []
            for f in futures:
                try:
                    outcomes.append(f.result(timeout=300)[1])
                except openai.APIStatusError as e:
                    outcomes.append(e.status_code)
        assert outcomes.count(503) >= 1 and "length" in outcomes
        assert set(outcomes) <= {503, "length"}
        assert complete(client, PROMPTS[1], 4, temperature=0)[1] == "length"  # and it still serves
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_requests_in_flight_then_exits(tiny_long: Path):
    s = Server(tiny_long, "--context", "4096")
    client = s.client()
    result: dict[str, object] = {}

    def run() -> None:
        result["out"] = complete(client, PROMPTS[0], 1500, stream=True, temperature=0)

    t = threading.Thread(target=run)
    t.start()
    assert wait_for(lambda: s.metrics()["specdraft_running_requests"] == 1)
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    assert not t.is_alive()
    text, finish = result["out"]  # type: ignore[misc]
    assert finish == "length" and text
    assert s.proc.wait(timeout=60) == 0
    s.stop()


@pytest.mark.real_model
def test_default_model_bf16_batch_invariant_mtp_equals_generate(tmp_path: Path):
    """The default model in bfloat16 with --batch-invariant and the shipped MTP module: a greedy
    chat request is byte-identical to plain `generate` while sampled requests run beside it."""
    from specdraft.model.loader import default_model_path
    from specdraft.errors import ModelFileError

    try:
        model = default_model_path()
    except ModelFileError:
        pytest.skip("the default model is not installed")
    loaded = load(model, dtype="bfloat16", batch_invariant=True)
    message = "Write a Python function that reverses a string."
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": message}])
    expected = build_engine(loaded, "plain").generate([ids], GenerationConfig(max_new_tokens=48))[0].text
    link = tmp_path / model.name  # the server's log goes next to its model
    link.symlink_to(model)
    s = Server(link, "--method", "mtp", "--policy", "fixed", "--k", "6", "--dtype", "bfloat16", "--batch-invariant",
               "--max-batch", "4", "--context", "512", "--threads", "2")
    try:
        client = s.client()
        chat = dict(model=MODEL_ID, max_tokens=48)
        with ThreadPoolExecutor(4) as pool:
            noise = [pool.submit(client.chat.completions.create, messages=[{"role": "user", "content": p}],
                                 temperature=0.8, seed=i, **chat) for i, p in enumerate(PROMPTS[:3])]
            mine = client.chat.completions.create(messages=[{"role": "user", "content": message}], temperature=0,
                                                  **chat)
            for f in noise:
                f.result()
        assert mine.choices[0].message.content == expected
        assert mine.usage.completion_tokens_details.accepted_prediction_tokens > 0  # it did speculate
    finally:
        assert s.stop() == 0


def test_bench_serve_interleaves_its_servers_and_pools_rounds(tiny_long: Path, tmp_path: Path):
    """``bench-serve`` on the tiny model: both servers up together, each cell run in every round
    (2), pooled into one row per engine, workload and concurrency, with the server's tau; the
    report and results are written, and the servers are stopped."""
    from specdraft.bench.serve import ServeBenchConfig, run_serve_bench

    cfg = ServeBenchConfig(methods=("plain", "ngram"), workloads=("code",), concurrency=(1, 2), requests=2,
                           max_tokens=8, model=str(tiny_long), threads=1, context=1024, rounds=2,
                           out=str(tmp_path / "bs"))
    lines: list[str] = []
    results = run_serve_bench(cfg, log=lines.append)
    cells = results["cells"]
    assert [(c["engine"], c["concurrency"]) for c in cells] == [
        ("specdraft:plain", 1), ("specdraft:ngram", 1), ("specdraft:plain", 2), ("specdraft:ngram", 2)]
    for c in cells:
        assert c["rounds"] == 2 and c["requests"] == 4 and c["errors"] == 0 and c["tokens"] > 0
        assert c["tau"] is not None and c["tau"] >= 1.0
        assert set(c["engine_s"]) == {"prefill", "propose", "verify", "other"}  # the server's time split
        assert c["engine_s"]["verify"] > 0 and 0 < sum(c["engine_s"].values()) < c["seconds"]
        assert len(c["round_throughput"]) == 2 and min(c["round_throughput"]) > 0
        pooled = c["tokens"] / c["seconds"]  # between the rounds' rates
        assert min(c["round_throughput"]) - 1e-9 <= pooled <= max(c["round_throughput"]) + 1e-9
    report = (tmp_path / "bs" / "report.md").read_text()
    assert "by round" in report and any(len(line.split(" / ")) == 2 for line in report.splitlines())
    assert "server s" in report and " of " in report  # the server's time split against the cell's wall time
    plain = next(c for c in cells if c["engine"] == "specdraft:plain")
    assert plain["tau"] == 1.0 and plain["engine_s"]["propose"] < 0.05 * plain["engine_s"]["verify"]  # no drafting
    ran = [line.split()[1] for line in lines if " c=" in line]  # engines in the order their cells ran
    assert len(ran) == 8 and ran[:2] != ran[2:4]  # the second round starts with the other server
    assert (tmp_path / "bs" / "report.md").exists()
    with pytest.raises(Exception, match="rounds"):
        ServeBenchConfig(rounds=0)


def test_bench_serve_open_loop_sends_at_a_rate_whatever_the_servers_pace(tiny_long: Path, tmp_path: Path):
    """``--rate``: requests arrive at seeded Poisson times, not when the last one ended. At 1,000
    requests a second the six requests are all sent within milliseconds, so several are in
    flight at once (a closed loop at concurrency 1 never has more than one); the report's rows
    are per rate, against plain's at the same rate."""
    from specdraft.bench.serve import ServeBenchConfig, arrivals, run_serve_bench

    times = arrivals(4.0, 4000, seed=3)
    assert times == sorted(times) and times[0] == 0.0 and times == arrivals(4.0, 4000, seed=3)
    assert abs(times[-1] / 3999 - 0.25) < 0.02  # mean gap 1 / rate
    assert arrivals(4.0, 50, seed=4) != times[:50]
    cfg = ServeBenchConfig(methods=("plain", "ngram"), workloads=("code",), rates=(1000.0,), requests=6, max_tokens=8,
                           model=str(tiny_long), threads=1, context=1024, out=str(tmp_path / "open"))
    results = run_serve_bench(cfg, log=lambda m: None)
    cells = results["cells"]
    assert [(c["engine"], c["rate"]) for c in cells] == [("specdraft:plain", 1000.0), ("specdraft:ngram", 1000.0)]
    for c in cells:
        assert c["requests"] == 6 and c["errors"] == 0 and c["tokens"] > 0
        assert c["concurrency"] >= 2  # the most requests in flight at once
    report = (tmp_path / "open" / "report.md").read_text()
    assert "rate/s" in report and "open loop" in report and "1.00x" in report  # plain against itself
    with pytest.raises(Exception, match="rates"):
        ServeBenchConfig(rates=(0.0,))
