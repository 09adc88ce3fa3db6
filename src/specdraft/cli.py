"""Command line: thin wrappers that parse options, build configs and call the library."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from specdraft.bench.runtime import MODES as RUNTIME_MODES
from specdraft.errors import SpecdraftError


def _add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="PATH", default=None,
                   help="a .gguf file or a Hugging Face model folder (config.json, *.safetensors, "
                        "tokenizer.json); default: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int4"],
                   help="numeric mode; float32 (default) is exact enough for byte-identical "
                        "speculative output; bfloat16 is faster on CPUs with native bf16 and exact "
                        "with --batch-invariant; int4 keeps a GGUF's Q4_0/Q4_1 layer matrices at 4 "
                        "bits and a Q8_0 LM head at 8 bits (CPU kernels, bfloat16 activations; about "
                        "2x bfloat16 at batch 1, exact with --batch-invariant; without AVX-512 "
                        "torch's int4 kernel and a bfloat16 LM head) and quantizes other formats' "
                        "layer matrices to 4 bits (lossy against the file); the embedding and an LM "
                        "head in another format are dequantized to bfloat16")
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="compute each token exactly as a one-token step would (attention per "
                        "draft token): speculative output equals plain output in bfloat16 too; "
                        "prompts cost about what they cost without it, verification a little more")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off, default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off, default)")
    g.add_argument("--seed", type=int, default=None, help="random seed, for reproducible sampling")


def _add_method_options(p: argparse.ArgumentParser, default: str = "plain") -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--method", default=default,
                   help=f"decoding method (default: {default}); `specdraft methods` lists them with their options")
    g.add_argument("--k", type=int, default=8,
                   help="draft tokens per step: the fixed length, or the maximum with --policy adaptive (default: 8)")
    g.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive (default): choose 0..k per step from recent acceptance and the measured "
                        "verification cost at this batch size; fixed: always k")
    g.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a method option, e.g. --opt max_n=4 --opt branches=2 (repeatable)")


def _options(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecdraftError(f"--opt takes KEY=VALUE, got {pair!r}")
        out[key.strip()] = value.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdraft",
        description="Speculative decoding for LLM text generation: faster, with the same output.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text, streamed to the terminal",
                         description="Generate text from a prompt or a chat message and stream it; "
                                     "prints tokens/s at the end (on stderr).")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text to continue (no chat template)")
    src.add_argument("--chat", metavar="MESSAGE", help="a user message, wrapped in the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat (default: the template's own)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when this text is generated (repeatable); the text is not printed")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    _add_model_options(gen)
    _add_sampling_options(gen)
    _add_method_options(gen)
    gen.set_defaults(func=cmd_generate)

    methods = sub.add_parser("methods", help="list the decoding methods and their options")
    methods.set_defaults(func=cmd_methods)

    ver = sub.add_parser("verify", help="check that speculative output equals plain output (temperature 0)",
                         description="Run plain and speculative greedy decoding on the same prompts and compare "
                                     "the outputs byte for byte. Reports each mismatch with its first differing "
                                     "position and exits 1 if any differ.")
    ver.add_argument("--prompts", action="append", default=[], metavar="WORKLOAD|FILE",
                     help="a built-in workload (summarization, rag, code, ...) or a JSONL file (repeatable); "
                          "default: every built-in workload, taken in turn")
    ver.add_argument("--limit", type=int, default=200, help="number of prompts (default: 200)")
    ver.add_argument("--max-new-tokens", type=int, default=64, help="tokens per turn (default: 64)")
    ver.add_argument("--out", default=None, metavar="FILE",
                     help="also write the report as JSON, and keep a journal of the finished prompts beside it "
                          "(FILE's stem + .progress.jsonl): rerunning the same command resumes there; delete the "
                          "journal to start over")
    _add_model_options(ver)
    _add_method_options(ver, default="ngram")
    ver.set_defaults(func=cmd_verify, policy="fixed")

    b = sub.add_parser("bench", help="benchmark methods x workloads x batch sizes against plain decoding",
                       description="Every method against plain decoding in the same run, on the same prompts and "
                                   "limits: tokens/s, speedup, tau, acceptance (overall and per draft position), "
                                   "time split. Writes results.json and report.md to --out.")
    b.add_argument("--quick", action="store_true",
                   help="a quick run (a few minutes on 2 CPU cores): every registered method with settings that "
                        "work out of the box (draft: the target's first 8 layers exported as a draft model; rest: "
                        "the standard-library datastore, built once), on repeat, code, math and chat, one "
                        "prompt at batch 1 (median of 3 rounds) and one batch of 8, 32 new tokens; options given "
                        "explicitly still win")
    b.add_argument("--methods", default=None,
                   help="comma-separated methods; settings after a colon, separated by '+', e.g. "
                        "'ngram,ngram:k=4+policy=fixed,ngram:branches=2' (default: ngram; plain always runs)")
    b.add_argument("--workloads", default=None,
                   help="comma-separated built-in workloads or NAME=FILE.jsonl (default: summarization,rag,code,creative); "
                        "built-in: " + ", ".join(_workload_names()))
    b.add_argument("--batch-sizes", default=None, help="comma-separated batch sizes (default: 1)")
    b.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default: 128)")
    b.add_argument("--samples", type=int, default=None,
                   help="requests per workload at batch 1; batch B runs max(1, samples // B) full batches (default: 8)")
    b.add_argument("--repeats", type=int, default=None,
                   help="timed repeats in rotated order; the median is reported (default: 1, or 3 at batch 1 with --quick)")
    b.add_argument("--batched-repeats", type=int, default=None,
                   help="timed repeats at batch sizes > 1 (default: as --repeats, or 1 with --quick)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    b.add_argument("--peers", default="",
                   help="also measure other engines at batch 1 on the same weights and prompts, each against its "
                        "own plain decoding: transformers (prompt_lookup_num_tokens), transformers-draft "
                        "(assistant_model = the run's draft:path=... model), llamacpp "
                        "(LlamaPromptLookupDecoding); skipped with a note when not installed")
    b.add_argument("--out", default=None, help="output folder (default: runs/bench, or runs/quick with --quick)")
    _add_model_options(b)
    b.set_defaults(func=cmd_bench)

    _add_serve_command(sub)

    rep = sub.add_parser("report", help="rebuild the report of a saved benchmark without rerunning it")
    rep.add_argument("folder", help="a benchmark output folder (with results.json)")
    rep.set_defaults(func=cmd_report)

    _add_datastore_commands(sub)
    from specdraft.cli_train import add_train_commands

    add_train_commands(sub, _add_model_options)

    bench = sub.add_parser("bench-runtime", help="benchmark the model runtime (plain decoding, verification cost)",
                           description="Plain greedy decoding in every numeric mode (float32, bfloat16, int4; "
                                       "with and without --batch-invariant) beside llama.cpp (llama-cpp-python, "
                                       "same GGUF) and Hugging Face transformers on the same prompts and token "
                                       "counts; each mode's verification cost curve (ms per forward against the "
                                       "new tokens q), where a decode step's time goes, and peak memory. Each "
                                       "mode runs in a process of its own. Writes runtime.json, report.md and "
                                       "plots.")
    bench.add_argument("--out", default="runs/runtime", help="output folder (default: runs/runtime)")
    bench.add_argument("--modes", default=",".join(RUNTIME_MODES),
                       help=f"comma-separated numeric modes (default: {','.join(RUNTIME_MODES)}; -bi = batch-invariant)")
    bench.add_argument("--peers", default="llamacpp,transformers",
                       help="comma-separated peers, or '' for none (default: llamacpp,transformers; a missing "
                            "package is skipped with a note)")
    bench.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default: 128)")
    bench.add_argument("--prompts", type=int, default=3, help="chat prompts decoded at batch 1 (default: 3)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats, median reported (default: 3)")
    bench.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes (default: 1,8)")
    bench.add_argument("--q", default="1,2,4,8,16,32,64", help="new tokens per forward for the cost curve")
    bench.add_argument("--no-profile", action="store_true", help="skip the per-mode profile of a decode step")
    bench.add_argument("--model", default=None, metavar="PATH", help="model (default: the embedded one)")
    bench.add_argument("--threads", type=int, default=None, help="CPU threads for torch and llama.cpp")
    bench.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    bench.set_defaults(func=cmd_bench_runtime)
    return parser


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                         description="Serve /v1/completions and /v1/chat/completions (streamed or not), /v1/models, "
                                     "/health and /metrics (Prometheus). Requests join the running batch between "
                                     "decode steps; the adaptive policy turns speculation off where it does not pay "
                                     "at the current batch size. The model is loaded once.")
    _add_model_options(srv)
    _add_method_options(srv)
    g = srv.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default: 16)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a slot; past it the server answers 503 (default: 256)")
    g.add_argument("--context", type=int, default=None,
                   help="tokens per request, prompt + output (default: the model's context, at most 2048); "
                        "the KV cache holds max-batch x context positions")
    g.add_argument("--max-tokens-in-flight", type=int, default=None,
                   help="the most positions the running requests may claim together (each its prompt plus its "
                        "max_tokens); a request waits for room past it, so many short requests run together where "
                        "few long ones would (default: max-batch x context; at least one context)")
    g.add_argument("--prefill-tokens", type=int, default=512,
                   help="prompt tokens fed between two decode steps: more gives new requests their first token "
                        "sooner, fewer keeps the running requests' tokens flowing (default: 512)")
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: the file's name)")
    g.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: warning)")
    g.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let requests in flight finish (default: 60)")
    g.add_argument("--allow-reset", action="store_true",
                   help="enable POST /reset_memory, which makes an idle server forget what it learned from earlier "
                        "requests (for benchmarks: `bench-serve` starts every cell from the same state)")
    srv.set_defaults(func=cmd_serve)

    bs = sub.add_parser("bench-serve", help="load-test the server: plain against speculative at several concurrencies",
                        description="Start `specdraft serve` once per method (and llama.cpp's server with --peers "
                                    "llamacpp), send each workload's prompts as streamed greedy chat requests through "
                                    "the OpenAI client at each concurrency (closed loop), and report throughput, "
                                    "TTFT, inter-token latency (p50/p99) and tau. Writes results.json, report.md "
                                    "and plots to --out.")
    bs.add_argument("--methods", default="plain,suffix",
                    help="comma-separated methods, options after a colon joined by '+', e.g. "
                         "'plain,suffix,mtp:topk=4' (default: plain,suffix; include plain for speedups)")
    bs.add_argument("--workloads", default="chat,code", help="comma-separated workloads (default: chat,code)")
    bs.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrencies (default: 1,4,16,64)")
    bs.add_argument("--rate", default=None, metavar="R1,R2",
                    help="open loop instead: requests arrive at these rates per second (Poisson, seeded), whatever "
                         "the server's pace (the servers' --max-batch: --max-batch, else the largest --concurrency)")
    bs.add_argument("--max-batch", type=int, default=None,
                    help="the servers' --max-batch (default: the largest --concurrency)")
    bs.add_argument("--requests", type=int, default=None,
                    help="requests per cell (default: max(8, 2 x concurrency); with --rate, max(16, 20 x rate))")
    bs.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default: 96)")
    bs.add_argument("--context", type=int, default=1024, help="the servers' tokens per request (default: 1024)")
    bs.add_argument("--peers", default="", help="llamacpp: llama-cpp-python's server on the same GGUF")
    bs.add_argument("--out", default="runs/bench-serve", help="output folder (default: runs/bench-serve)")
    bs.add_argument("--rounds", type=int, default=1,
                    help="times each cell runs, the servers in rotated order; a cell pools its rounds (default: 1)")
    bs.add_argument("--peer-concurrency", type=int, default=16,
                    help="the largest concurrency a peer server runs (default: 16)")
    bs.add_argument("--model", default=None, metavar="PATH", help="model (default: the embedded one)")
    bs.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "int4"])
    bs.add_argument("--batch-invariant", action="store_true")
    bs.add_argument("--threads", type=int, default=None, help="CPU threads of each server")
    bs.set_defaults(func=cmd_bench_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from specdraft.server.main import ServeConfig, serve

    for flag, value, least in (("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 1),
                               ("--prefill-tokens", args.prefill_tokens, 1), ("--context", args.context, 2),
                               ("--max-tokens-in-flight", args.max_tokens_in_flight, 2)):
        if value is not None and value < least:
            raise SpecdraftError(f"{flag} must be >= {least}, got {value}")
    _set_threads(args.threads)
    cfg = ServeConfig(model=args.model, method=args.method, k=args.k, policy=args.policy,
                      options=tuple(_options(args.opt).items()), dtype=args.dtype, device=args.device,
                      batch_invariant=args.batch_invariant, max_batch=args.max_batch, max_queue=args.max_queue,
                      context=args.context, max_tokens_in_flight=args.max_tokens_in_flight,
                      prefill_tokens=args.prefill_tokens, host=args.host, port=args.port, served_name=args.served_model_name,
                      log_level=args.log_level, shutdown_timeout=args.shutdown_timeout,
                      allow_reset=args.allow_reset)
    return serve(cfg)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specdraft.bench.serve import ServeBenchConfig, run_serve_bench

    if args.requests is not None and args.requests < 1:
        raise SpecdraftError(f"--requests must be >= 1, got {args.requests}")
    cfg = ServeBenchConfig(methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
                           workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
                           concurrency=_int_list(args.concurrency, "--concurrency"), requests=args.requests,
                           max_tokens=args.max_tokens, model=args.model, dtype=args.dtype,
                           batch_invariant=args.batch_invariant, threads=args.threads, context=args.context,
                           peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()), out=args.out,
                           rounds=args.rounds, peer_concurrency=args.peer_concurrency,
                           rates=_float_list(args.rate, "--rate") if args.rate else (), max_batch=args.max_batch)
    run_serve_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    from pathlib import Path

    print((Path(cfg.out) / "report.md").read_text())
    return 0


def _add_datastore_commands(sub: argparse._SubParsersAction) -> None:
    ds = sub.add_parser("datastore", help="build or inspect a retrieval datastore (for --method rest)",
                        description="A datastore is a corpus tokenized with the target's tokenizer and indexed by "
                                    "a suffix array, in one file; the rest method drafts what followed the "
                                    "context's suffix in it.")
    actions = ds.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = actions.add_parser("build", help="tokenize a corpus and index it",
                           description="Tokenize a corpus with the model's tokenizer (the weights are not loaded), "
                                       "build its suffix array and save both in one file.")
    b.add_argument("--stdlib", action="store_true",
                   help="index this Python's standard library source (.py files; tests and site-packages skipped): "
                        "a good default for code; without --out it goes where --method rest looks by default")
    b.add_argument("--corpus", action="append", default=[], metavar="PATH",
                   help="a text file or a folder of them to index (repeatable)")
    b.add_argument("--glob", default=None, metavar="PATTERN",
                   help="which files of a --corpus folder, e.g. '**/*.md' (default: every UTF-8 text file)")
    b.add_argument("--model", default=None, metavar="PATH",
                   help="the model whose tokenizer to use (default: the embedded SmolLM2-135M-Instruct)")
    b.add_argument("--max-tokens", type=int, default=20_000_000,
                   help="most tokens to index; later files are cut (default: 20,000,000, about 160 MB on disk)")
    b.add_argument("--out", default=None, metavar="FILE",
                   help="output file (default: $SPECDRAFT_DATASTORES or ~/.cache/specdraft/datastores, named "
                        "stdlib-<tokenizer fingerprint>.sdds with --stdlib alone, else after the first corpus path)")
    b.set_defaults(func=cmd_datastore_build)
    info = actions.add_parser("info", help="check a datastore file and print its header")
    info.add_argument("file", help="a datastore file (.sdds)")
    info.set_defaults(func=cmd_datastore_info)


def cmd_datastore_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.corpus import CorpusSpec
    from specdraft.datastore import build_datastore, default_datastore_path, load_tokenizer

    spec = CorpusSpec(stdlib=args.stdlib, paths=tuple(args.corpus), glob=args.glob)
    tokenizer, model = load_tokenizer(args.model)
    name = "stdlib" if not args.corpus else Path(args.corpus[0]).expanduser().resolve().stem
    out = args.out or default_datastore_path(tokenizer, name)
    built = build_datastore(spec, tokenizer, out, max_tokens=args.max_tokens, model=model.name, progress=True)
    print(f"datastore: {built.path} ({built.store.info.tokens:,} tokens from {built.files} files, "
          f"{built.skipped} skipped; {built.path.stat().st_size / 1e6:.1f} MB; built in {built.seconds:.1f} s)")
    return 0


def cmd_datastore_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from specdraft.datastore import FORMAT_VERSION, load

    store = load(args.file)
    print(f"file: {args.file}\nformat: {FORMAT_VERSION}\nsize: {store.nbytes:,} bytes")
    for key, value in asdict(store.info).items():
        print(f"{key}: {value}")
    return 0


def _set_threads(n: int | None) -> None:
    from specdraft.model.loader import set_threads

    if n is not None and n < 1:
        raise SpecdraftError(f"--threads must be >= 1, got {n}")
    set_threads(n)


def _workload_names() -> list[str]:
    from specdraft.workloads import WORKLOADS

    return list(WORKLOADS)


QUICK_WORKLOADS = "repeat,code,math,chat"  # copying, code, reasoning, conversation: short prompts, a few minutes


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.bench.harness import BenchConfig, MethodSpec, run_bench
    from specdraft.bench.report import write_report

    _set_threads(args.threads)
    if args.quick:
        from specdraft.bench.quick import quick_methods

        methods = quick_methods(args.model) if args.methods is None else []
        # one 32-token request per cell takes about 2 s, and a shared CPU's noise is of the order of
        # 10-20% over that: batch 1 (the column people read first) takes the median of 3 rounds
        preset = {"methods": ",".join(m.replace(",", "+") for m in methods),
                  "workloads": QUICK_WORKLOADS, "batch_sizes": "1,8", "max_new_tokens": 32, "samples": 1,
                  "repeats": 3, "batched_repeats": 1, "out": "runs/quick"}
    else:
        preset = {"methods": "ngram", "workloads": "summarization,rag,code,creative", "batch_sizes": "1",
                  "max_new_tokens": 128, "samples": 8, "repeats": 1, "out": "runs/bench"}
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    methods = tuple(MethodSpec.parse(m.replace("+", ",")) for m in args.methods.split(",") if m.strip())
    cfg = BenchConfig(methods=methods, workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
                      batch_sizes=_int_list(args.batch_sizes, "--batch-sizes"), max_new_tokens=args.max_new_tokens,
                      samples=args.samples, repeats=args.repeats, batched_repeats=args.batched_repeats,
                      temperature=args.temperature, seed=args.seed,
                      model=args.model, dtype=args.dtype, device=args.device, out=args.out,
                      batch_invariant=args.batch_invariant,
                      peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()))
    results = run_bench(cfg)
    path = write_report(Path(cfg.out), results)
    print(path.read_text())
    print(f"results: {Path(cfg.out) / 'results.json'}\nreport:  {path}")
    plots = sorted(p.name for p in Path(cfg.out).glob("*.png"))
    if plots:
        print(f"plots:   {Path(cfg.out)}/ ({', '.join(plots)})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.bench.report import write_report

    path = write_report(Path(args.folder))
    print(path.read_text())
    print(f"report: {path}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from specdraft.proposers import describe_methods

    print(describe_methods())
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from specdraft.verify import VerifyConfig, run_verify

    if args.limit < 1:
        raise SpecdraftError(f"--limit must be >= 1, got {args.limit}")
    _set_threads(args.threads)
    cfg = VerifyConfig(method=args.method, prompts=tuple(args.prompts), limit=args.limit,
                       max_new_tokens=args.max_new_tokens, k=args.k, policy=args.policy,
                       options=tuple(_options(args.opt).items()), model=args.model, dtype=args.dtype,
                       batch_invariant=args.batch_invariant,
                       device=args.device, out=args.out)
    report = run_verify(cfg)
    if report.mismatches:
        return 1
    return 130 if report.interrupted else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from specdraft.api import build_engine
    from specdraft.metrics import SpecStats
    from specdraft.model.loader import load
    from specdraft.sampling import Sampling
    from specdraft.sequence import GenerationConfig

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    _set_threads(args.threads)
    options = _options(args.opt)
    t0 = time.perf_counter()
    loaded = load(args.model, dtype=args.dtype, device=args.device, batch_invariant=args.batch_invariant)
    load_s = time.perf_counter() - t0
    engine = build_engine(loaded, args.method, k=args.k, policy=args.policy, options=options)
    tok = loaded.tokenizer
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}
        ]
        prompt = tok.encode_chat(messages)
    else:
        prompt = tok.encode(args.prompt)
    stats = SpecStats()
    results = engine.generate([prompt], config, sampling, on_text=lambda e: print(e.text, end="", flush=True),
                              stats=stats)
    print()
    r = results[0]
    print(
        f"[{args.method}: {len(r.tokens)} tokens in {stats.decode_s:.2f} s, {len(r.tokens) / max(stats.decode_s, 1e-9):.1f} tok/s; "
        f"prompt {r.prompt_tokens} tokens in {stats.prefill_s:.2f} s; model loaded in {load_s:.1f} s; "
        f"finish: {r.finish_reason}]",
        file=sys.stderr,
    )
    if engine.speculative:
        print(f"[{stats.summary()}]", file=sys.stderr)
    return 0


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    from specdraft.bench.runtime import RuntimeBenchConfig, run_runtime_bench

    _set_threads(args.threads)
    if args.new_tokens < 2 or args.prompts < 1 or args.repeats < 1:
        raise SpecdraftError("--new-tokens must be >= 2, --prompts and --repeats >= 1")
    cfg = RuntimeBenchConfig(
        model=args.model,
        out=args.out,
        new_tokens=args.new_tokens,
        prompts=args.prompts,
        repeats=args.repeats,
        batch_sizes=_int_list(args.batch_sizes, "--batch-sizes"),
        q_values=_int_list(args.q, "--q"),
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        peers=tuple(p.strip() for p in args.peers.split(",") if p.strip()),
        profile=not args.no_profile,
        device=args.device,
        threads=args.threads,
    )
    run_runtime_bench(cfg)
    return 0


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecdraftError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SpecdraftError(f"{option} needs positive integers, got {text!r}")
    return values


def _float_list(text: str, option: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecdraftError(f"{option} takes comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v < float("inf") for v in values):
        raise SpecdraftError(f"{option} needs positive finite numbers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecdraftError as e:
        print(f"specdraft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdraft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
