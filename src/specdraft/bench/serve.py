"""``specdraft bench-serve``: the server under load, plain against speculative, through the
OpenAI client.

For each method a ``specdraft serve`` subprocess is started on a free loopback port (the same
model, dtype and limits) and warmed with one request; all of them stay up (an idle server
waits without using the CPU). Then each workload is sent at each concurrency to every server
in turn, the order rotated from one cell to the next, so that the engines compared in a row of
the report ran minutes apart, not an hour (this machine's speed drifts by 10-20% over an hour),
and ``rounds`` times (a cell's numbers pool its rounds). A cell: ``concurrency`` client
threads, each sending its next streamed chat request as soon as the last one ended (a closed
loop), ``requests`` requests, greedy; or, with ``rates``, an open loop: requests arrive at
``rate`` per second at seeded Poisson times whatever the server's pace (as traffic does), each
on its own thread, so that a server slower than the rate builds a queue, and past its
``--max-queue`` refuses requests (counted as errors); before each cell the server forgets what it learned from
earlier ones (``--allow-reset``: prompts repeat across cells, and suffix decoding would
otherwise copy its own earlier answers). A peer (llama.cpp's server decodes one request at a
time) runs up to ``peer_concurrency``. Measured
per request on the client: time to first token (TTFT), the gaps between streamed chunks (ITL;
a speculative chunk may hold several tokens, as in vLLM's serving benchmark), time per output
token after the first (TPOT) and the tokens (the usage the server reports); per cell: output
tokens per second of wall time, and tau from the server's /metrics. llama.cpp's own server
(llama-cpp-python, on the same GGUF) is measured the same way where it is installed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError

HOST = "127.0.0.1"
PROMPT_CHARS = 2000  # a user message is cut to this many characters (the context is short on purpose)
STARTUP_TIMEOUT_S = 900  # model load + the policy's cost measurement at every batch size
OPEN_LOOP_THREADS = 256  # an open-loop cell's client threads: requests past this many in flight wait on the client


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    methods: tuple[str, ...] = ("plain", "suffix")  # "name" or "name:key=value+key=value" (method options)
    workloads: tuple[str, ...] = ("chat", "code")
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    requests: int | None = None  # per cell; default max(8, 2 x concurrency)
    max_tokens: int = 96
    model: str | None = None
    dtype: str = "float32"
    batch_invariant: bool = False
    threads: int | None = None
    context: int = 1024
    peers: tuple[str, ...] = ()  # "llamacpp"
    peer_concurrency: int = 16  # a peer's largest concurrency (llama.cpp's server queues past 1)
    rounds: int = 1  # times each cell is run (engines in rotated order); its numbers pool them
    out: str = "runs/bench-serve"
    rates: tuple[float, ...] = ()  # requests per second (open loop, Poisson arrivals): run these instead of concurrencies
    seed: int = 0  # the open loop's arrival times
    max_batch: int | None = None  # the servers' --max-batch (None: the largest concurrency)

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.peer_concurrency < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise SpecdraftError("bench-serve: rounds, concurrencies and peer_concurrency must be >= 1")
        if self.max_batch is not None and self.max_batch < 1:
            raise SpecdraftError(f"bench-serve: max_batch must be >= 1, got {self.max_batch}")
        if any(not r > 0 or r != r or r == float("inf") for r in self.rates):
            raise SpecdraftError(f"bench-serve: request rates must be finite and > 0, got {list(self.rates)}")

    @property
    def server_batch(self) -> int:
        return self.max_batch if self.max_batch is not None else max(self.concurrency)

    def requests_at(self, concurrency: int) -> int:
        return self.requests if self.requests is not None else max(8, 2 * concurrency)

    def requests_at_rate(self, rate: float) -> int:
        """An open-loop cell's requests: about 20 seconds of arrivals (at least 16)."""
        return self.requests if self.requests is not None else max(16, round(20 * rate))

    @property
    def loads(self) -> list[tuple[int, float | None]]:
        """The cells' loads: (concurrency, None) for a closed loop; (0, rate) for an open one."""
        return [(0, r) for r in self.rates] if self.rates else [(c, None) for c in self.concurrency]


@dataclass(slots=True)
class Cell:
    engine: str  # "specdraft:<method>" or "llamacpp"
    method: str
    workload: str
    concurrency: int
    requests: int
    seconds: float
    tokens: int
    errors: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    passes: float = 0.0  # target passes, tokens emitted, drafted and accepted (the server's /metrics)
    emitted: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0
    engine_s: dict[str, float] = field(default_factory=dict)  # the server's scheduler time by phase (/metrics)
    rounds: int = 1
    round_throughput: list[float] = field(default_factory=list)  # tok/s of each round, in order
    rate: float | None = None  # an open-loop cell's requests per second (concurrency: the most in flight seen)

    def __post_init__(self) -> None:
        if not self.round_throughput and self.seconds > 0:
            self.round_throughput = [self.throughput]

    @property
    def tau(self) -> float | None:
        return self.emitted / self.passes if self.passes > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.passes > 0 and self.drafted > 0 else None

    def merge(self, other: "Cell") -> None:
        """Pool another round of the same cell into this one."""
        for name in ("requests", "seconds", "tokens", "errors", "passes", "emitted", "drafted", "accepted", "rounds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.round_throughput += other.round_throughput
        self.concurrency = max(self.concurrency, other.concurrency) if self.rate is not None else self.concurrency
        for phase, secs in other.engine_s.items():
            self.engine_s[phase] = self.engine_s.get(phase, 0.0) + secs
        self.ttft += other.ttft
        self.itl += other.itl
        self.tpot += other.tpot

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        return {"engine": self.engine, "method": self.method, "workload": self.workload,
                "concurrency": self.concurrency, "rate": self.rate, "requests": self.requests, "errors": self.errors,
                "seconds": self.seconds, "tokens": self.tokens, "throughput": self.throughput,
                "ttft_p50": _pct(self.ttft, 50), "ttft_p99": _pct(self.ttft, 99),
                "itl_p50": _pct(self.itl, 50), "itl_p99": _pct(self.itl, 99), "tpot_p50": _pct(self.tpot, 50),
                "tau": self.tau, "acceptance": self.acceptance, "rounds": self.rounds,
                "round_throughput": self.round_throughput, "engine_s": self.engine_s}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a subprocess, up once /health (or /v1/models) answers; stopped with SIGTERM."""

    def __init__(self, cmd: list[str], port: int, name: str, log_dir: Path, health: str = "/health") -> None:
        self.port, self.name = port, name
        self.log_path = log_dir / f"server-{name.replace(':', '_').replace('=', '-')}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                tail = self.log_path.read_text()[-800:]
                raise SpecdraftError(f"the {name} server exited with {self.proc.returncode}: {tail.strip()}")
            try:
                with urllib.request.urlopen(f"{self.url}{health}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SpecdraftError(f"the {name} server did not answer within {STARTUP_TIMEOUT_S} s (log: {self.log_path})")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stop(self) -> int:
        """SIGTERM (a kill if it hangs); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics as {series: value} ({} when it has none)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def reset(url: str) -> None:
    """Make an idle specdraft server forget its earlier requests (POST /reset_memory): a method
    that remembers earlier outputs (suffix) must not draft a cell's answers from the same
    prompts' answers in an earlier cell."""
    req = urllib.request.Request(f"{url}/reset_memory", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        if r.status != 200:
            raise SpecdraftError(f"the server did not reset its memory (status {r.status})")


def _metric(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


def one_request(client: Any, model: str, message: str, max_tokens: int, count_tokens: Any,
                usage_chunk: bool = True) -> dict[str, Any]:
    """One streamed greedy chat request: TTFT, chunk gaps, tokens (the server's usage chunk, or
    the text re-tokenized where the server sends none), end-to-end seconds."""
    t0 = time.perf_counter()
    first, last, gaps, parts, usage = None, None, [], [], None
    extra = {"stream_options": {"include_usage": True}} if usage_chunk else {}
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": message}],
                                            max_tokens=max_tokens, temperature=0, stream=True, **extra)
    for chunk in stream:
        now = time.perf_counter()
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
        text = "".join(c.delta.content or "" for c in chunk.choices if c.delta is not None)
        if not text:
            continue
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        parts.append(text)
    end = time.perf_counter()
    text = "".join(parts)
    tokens = usage.completion_tokens if usage is not None else count_tokens(text)
    ttft = (first - t0) if first is not None else end - t0
    tpot = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens, "tpot": tpot, "seconds": end - t0}


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Seconds from the start at which n requests arrive at ``rate`` per second (a Poisson process)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_cell(url: str, model: str, engine: str, method: str, workload: str, messages: list[str], concurrency: int,
             n_requests: int, max_tokens: int, count_tokens: Any, rate: float | None = None, seed: int = 0) -> Cell:
    """One cell: ``n_requests`` requests at ``concurrency`` (closed loop) or, given ``rate``, arriving
    at that many per second (open loop; the cell's concurrency is then the most in flight)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    if engine.startswith("specdraft"):
        reset(url)  # the cell starts from what the server knew before any request (as `bench`'s repeats)
    before = scrape(url)
    lock = threading.Lock()
    next_index = [0]
    results: list[dict[str, Any]] = []
    errors = [0]
    in_flight = [0, 0]  # now, most

    def send(i: int) -> None:
        with lock:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
        try:
            r = one_request(client, model, messages[i % len(messages)], max_tokens, count_tokens,
                            usage_chunk=engine.startswith("specdraft"))
        except Exception as e:  # noqa: BLE001  (a failed request is counted, the cell goes on)
            print(f"bench-serve: request failed: {type(e).__name__}: {e}", file=sys.stderr)
            with lock:
                errors[0] += 1
            return
        finally:
            with lock:
                in_flight[0] -= 1
        with lock:
            results.append(r)

    def worker() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= n_requests:
                    return
                next_index[0] += 1
            send(i)

    t0 = time.perf_counter()
    if rate is None:
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(worker) for _ in range(concurrency)]:
                f.result()
    else:
        with ThreadPoolExecutor(min(n_requests, OPEN_LOOP_THREADS)) as pool:
            futures = []
            for i, at in enumerate(arrivals(rate, n_requests, seed)):
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                futures.append(pool.submit(send, i))
            for f in futures:
                f.result()
        concurrency = in_flight[1]
    seconds = time.perf_counter() - t0
    after = scrape(url)
    cell = Cell(engine, method, workload, concurrency, n_requests, seconds, sum(r["tokens"] for r in results),
                errors[0], [r["ttft"] for r in results], [g for r in results for g in r["gaps"]],
                [r["tpot"] for r in results if r["tpot"] is not None], rate=rate)
    for field_, series in (("passes", "target_passes"), ("emitted", "generation_tokens"), ("drafted", "draft_tokens"),
                           ("accepted", "accepted_tokens")):
        name = f"specdraft_{series}_total"
        setattr(cell, field_, _metric(after, name) - _metric(before, name))
    for phase in ("prefill", "propose", "verify", "other"):  # where the server's scheduler spent the cell
        names = [k for k in after if k.startswith("specdraft_engine_seconds_total{") and f'phase="{phase}"' in k]
        if names:
            cell.engine_s[phase] = sum(after[k] - before.get(k, 0.0) for k in names)
    return cell


def workload_messages(workloads: tuple[str, ...]) -> dict[str, list[str]]:
    from specdraft.workloads import load_workload, workload_label

    return {workload_label(w): [p.turns[0][:PROMPT_CHARS] for p in load_workload(w)] for w in workloads}


def _specdraft_cmd(cfg: ServeBenchConfig, method: str, port: int) -> list[str]:
    name, _, opts = method.partition(":")
    cmd = [sys.executable, "-m", "specdraft", "serve", "--port", str(port), "--host", HOST, "--method", name,
           "--dtype", cfg.dtype, "--max-batch", str(cfg.server_batch), "--max-queue", str(4 * max(cfg.concurrency)),
           "--context", str(cfg.context), "--served-model-name", "bench", "--allow-reset"]
    for opt in filter(None, opts.split("+")):
        key, _, value = opt.partition("=")
        if key in ("k", "policy"):
            cmd += [f"--{key}", value]
        else:
            cmd += ["--opt", opt]
    if cfg.model:
        cmd += ["--model", cfg.model]
    if cfg.batch_invariant:
        cmd.append("--batch-invariant")
    if cfg.threads:
        cmd += ["--threads", str(cfg.threads)]
    return cmd


def _llamacpp_cmd(cfg: ServeBenchConfig, gguf: Path, port: int) -> list[str]:
    threads = cfg.threads or os.cpu_count() or 1
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", HOST, "--port", str(port),
            "--n_ctx", str(cfg.context), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--model_alias", "bench", "--verbose", "False",
            "--interrupt_requests", "False"]  # (its default: a new request interrupts the one running)


def llamacpp_unavailable() -> str | None:
    import importlib.util

    for module in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            return f"llama-cpp-python's server is not installed ({module} missing: pip install 'llama-cpp-python[server]')"
    return None


def run_serve_bench(cfg: ServeBenchConfig, log: Any = print) -> dict[str, Any]:
    from specdraft.bench.machine import machine_info
    from specdraft.model.loader import default_model_path
    from specdraft.datastore import load_tokenizer

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    messages = workload_messages(cfg.workloads)
    tokenizer, _ = load_tokenizer(cfg.model)
    count = lambda text: len(tokenizer.encode(text, add_bos=False, add_eos=False))  # noqa: E731
    cells: list[Cell] = []
    notes: list[str] = []
    engines: list[tuple[str, str, list[str] | None]] = []
    for method in cfg.methods:
        engines.append((f"specdraft:{method}", method, None))
    gguf = Path(cfg.model) if cfg.model else default_model_path()
    for peer in cfg.peers:
        if peer != "llamacpp":
            raise SpecdraftError(f"unknown serving peer {peer!r} (known: llamacpp)")
        why = llamacpp_unavailable() or (None if gguf.suffix == ".gguf" else "llama.cpp needs a GGUF model")
        if why:
            notes.append(f"llamacpp skipped: {why}")
            log(f"bench-serve: {notes[-1]}")
        else:
            engines.append(("llamacpp", "plain", []))
    servers: list[tuple[str, str, ServerProcess]] = []
    try:
        for engine, method, _ in engines:
            port = free_port()
            cmd = _llamacpp_cmd(cfg, gguf, port) if engine == "llamacpp" else _specdraft_cmd(cfg, method, port)
            log(f"bench-serve: starting {engine}")
            try:
                server = ServerProcess(cmd, port, engine, out, health="/v1/models" if engine == "llamacpp" else "/health")
            except SpecdraftError as e:
                notes.append(str(e))
                log(f"bench-serve: {e}")
                continue
            servers.append((engine, method, server))
            run_cell(server.url, "bench", engine, method, "warmup", next(iter(messages.values())), 1, 1, 16, count)
        turn = 0
        for workload, msgs in messages.items():
            for c, rate in cfg.loads:
                here = [x for x in servers if x[0].startswith("specdraft") or rate is not None or c <= cfg.peer_concurrency]
                n = cfg.requests_at(c) if rate is None else cfg.requests_at_rate(rate)
                pooled: dict[str, Cell] = {}
                for _ in range(cfg.rounds):
                    for engine, method, server in here[turn % len(here):] + here[: turn % len(here)]:
                        cell = run_cell(server.url, "bench", engine, method, workload, msgs, c, n, cfg.max_tokens,
                                        count, rate, cfg.seed)
                        _log_cell(log, cell)
                        if engine in pooled:
                            pooled[engine].merge(cell)
                        else:
                            pooled[engine] = cell
                    turn += 1
                cells.extend(pooled[e] for e, _, _ in here if e in pooled)
                _save(out, cfg, cells, notes, machine_info())
    finally:
        for _, _, server in servers:
            server.stop()
    results = _save(out, cfg, cells, notes, machine_info())
    from specdraft.bench.serve_report import write_serve_report

    write_serve_report(out, results)
    return results


def _log_cell(log: Any, cell: Cell) -> None:
    s = cell.summary()
    tau = f", tau {s['tau']:.2f}" if s["tau"] is not None else ""
    load = f"c={cell.concurrency:<3}" if cell.rate is None else f"rate={cell.rate:g}/s (c<={cell.concurrency})"
    log(f"bench-serve: {cell.engine:<22} {cell.workload:<10} {load} {s['throughput']:7.1f} tok/s, "
        f"TTFT p50 {s['ttft_p50'] or 0:.2f} s{tau}" + (f", {cell.errors} errors" if cell.errors else ""))


def _save(out: Path, cfg: ServeBenchConfig, cells: list[Cell], notes: list[str], machine: dict[str, Any]) -> dict[str, Any]:
    results = {"config": asdict(cfg), "machine": machine, "notes": notes, "cells": [c.summary() for c in cells]}
    tmp = tempfile.NamedTemporaryFile("w", dir=out, delete=False, suffix=".tmp")
    with tmp:
        json.dump(results, tmp, indent=1)
    os.replace(tmp.name, out / "results.json")
    return results
