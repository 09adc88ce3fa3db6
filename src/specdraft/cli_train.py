"""The ``specdraft train ...`` commands (argument parsing only; the work is in ``train/``)."""

from __future__ import annotations

import argparse
import json

from specdraft.errors import SpecdraftError


def _data_options(p: argparse.ArgumentParser, held_out: bool) -> None:
    """--data (one or several data folders) and, for training, --held-out."""
    p.add_argument("--data", required=True, metavar="DIR[,DIR]",
                   help="a folder written by `specdraft train data`, or several, comma-separated")
    if held_out:
        p.add_argument("--held-out", metavar="DIR[,DIR]", default=None,
                       help="measure on these folders' validation answers instead of --data's (e.g. --data holds "
                            "second answers only)")


def add_train_commands(sub: argparse._SubParsersAction, add_model_options) -> None:  # type: ignore[no-untyped-def]
    train = sub.add_parser("train", help="make training data for drafters from the target's own outputs",
                           description="Drafters (EAGLE, Medusa, MTP heads) must predict this model, so their "
                                       "data is the target's own answers to training prompts.")
    actions = train.add_subparsers(dest="action", required=True, metavar="ACTION")
    d = actions.add_parser("data", help="answer training prompts with the target (resumable, sharded)",
                           description="Runs the target over the training prompts found in --prompts (the upstream layouts "
                                       "of GPTeacher, Alpaca-Libre, OASST and the self-instruct seeds; see "
                                       "specdraft.train.prompts) "
                                       "and writes its answers as token shards to --out. Rerun the same command to "
                                       "resume: prompts already in a shard are skipped. Evaluation sets are never read.")
    d.add_argument("--prompts", required=True, metavar="DIR", help="folder of training prompt sets")
    d.add_argument("--out", required=True, metavar="DIR", help="output folder (manifest.json + shard-*.jsonl)")
    d.add_argument("--sources", default=None,
                   help="comma-separated sources (default: all found): gpteacher-codegen, gpteacher-roleplay, "
                        "alpaca-libre, oasst1, oasst-samples, self-instruct-seed")
    d.add_argument("--limit", type=int, default=None, help="answer at most this many prompts in all (default: all)")
    d.add_argument("--split", default="train,validation", help="which splits to answer (default: both)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="longest answer (default: 256)")
    d.add_argument("--temperatures", default="0,0.7",
                   help="prompt i is answered at the (i mod n)-th of these (default: 0,0.7: greedy and sampled)")
    d.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (default: 512)")
    d.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default: 16)")
    d.add_argument("--shard-size", type=int, default=64, help="prompts per shard, the unit of resumption (default: 64)")
    d.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start no new shard after this long (default: none)")
    d.add_argument("--seed", type=int, default=0, help="base seed of the sampled answers (default: 0)")
    add_model_options(d)
    d.set_defaults(func=cmd_train_data)
    v = actions.add_parser("vocab", help="how much of the target's answers a reduced draft vocabulary covers",
                           description="For each size, the most frequent tokens of the train split's answers and the "
                                       "share of the held-out answers' tokens they cover (the best acceptance any "
                                       "head with that vocabulary can reach).")
    v.add_argument("folder", help="a folder written by `specdraft train data`")
    v.add_argument("--sizes", default="1024,2048,4096,8192,16384,32000", help="vocabulary sizes to compare")
    v.add_argument("--vocab-size", type=int, default=None, help="the target's vocabulary (default: from the data)")
    v.add_argument("--always", type=int, action="append", default=[2], metavar="ID",
                   help="ids always kept (default: 2, the default model's EOS; repeatable)")
    v.set_defaults(func=cmd_train_vocab)
    m = actions.add_parser("medusa", help="train Medusa heads on the target's own answers (resumable)",
                           description="Heads learn the target's own distribution k tokens ahead on the train split of "
                                       "a `specdraft train data` folder; the held-out tau per head is printed at the "
                                       "end. Rerun the same command to resume after an interrupt.")
    _data_options(m, held_out=True)
    m.add_argument("--out", required=True, metavar="DIR", help="output folder (checkpoint, then config.json + model.safetensors)")
    m.add_argument("--heads", type=int, default=3, help="K, tokens guessed past the bonus token (default: 3)")
    m.add_argument("--draft-vocab", type=int, default=4096, help="reduced vocabulary size (default: 4096)")
    m.add_argument("--epochs", type=int, default=1, help="passes over the train split (default: 1)")
    m.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 0.001)")
    m.add_argument("--limit", type=int, default=None, help="train answers used (default: all)")
    m.add_argument("--sources", default="", help="only the answers to these prompt sets, comma-separated (e.g. alpaca-libre,oasst1), in both splits; default: all")
    m.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch (default: 2048)")
    m.add_argument("--init", default="", metavar="DIR",
                   help="start from these trained medusa heads (their draft vocabulary; --heads and --draft-vocab must "
                        "match; e.g. to go on training the shipped ones on more data) instead of the target's LM head")
    m.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="stop with a checkpoint after this long")
    m.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    add_model_options(m)
    m.set_defaults(func=cmd_train_medusa)
    for kind, what in (("eagle", "an EAGLE-3 head: one decoder layer over the target's fused low/mid/high features"),
                       ("mtp", "an MTP module (DeepSeek-V3 layout): a projection of the target's last layer and the "
                               "next token's embedding, then one decoder layer")):
        e = actions.add_parser(kind, help=f"train {what.split(':')[0]} on the target's own answers (resumable)",
                               description=f"Trains {what}. It learns the target's own next-token distribution with "
                                           "EAGLE-3's training-time test (fed its own states for --steps steps). The "
                                           "held-out acceptance per draft position and tau are printed at the end. "
                                           "Rerun the same command to resume after an interrupt.")
        _data_options(e, held_out=True)
        e.add_argument("--out", required=True, metavar="DIR", help="output folder (checkpoint, then config.json + model.safetensors)")
        e.add_argument("--draft-vocab", type=int, default=4096, help="reduced vocabulary size (default: 4096)")
        e.add_argument("--steps", type=int, default=3, help="training-time test steps (default: 3)")
        if kind == "eagle":
            e.add_argument("--taps", default="", help="comma-separated target layers to fuse (default: EAGLE-3's 2, L/2, L-3)")
        e.add_argument("--epochs", type=int, default=1, help="passes over the train split (default: 1)")
        e.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default: 0.001)")
        e.add_argument("--limit", type=int, default=None, help="train answers used (default: all)")
        e.add_argument("--sources", default="", help="only the answers to these prompt sets, comma-separated (e.g. alpaca-libre,oasst1), in both splits; default: all")
        e.add_argument("--references", type=int, default=0,
                       help="also train on this many train-split prompts with the data set's own answers (teacher "
                            "forcing; from the --sources sets when given; needs --prompts)")
        e.add_argument("--prompts", default=None, metavar="DIR", help="training prompts folder, for --references")
        e.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per batch (default: 1024)")
        e.add_argument("--init", default="", metavar="DIR",
                       help=f"start from this trained {kind} folder (its draft vocabulary{' and taps' if kind == 'eagle' else ''}; "
                            "e.g. to go on training the shipped one on more data) instead of the target's logit lens")
        e.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="stop with a checkpoint after this long")
        e.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
        add_model_options(e)
        e.set_defaults(func=cmd_train_head, kind=kind)
    a = actions.add_parser("layer-skip", help="train an early-exit adapter for self-speculation (Kangaroo; resumable)",
                           description="One attention layer and a norm between the target's first L layers and its LM "
                                       "head learn the target's own next-token distribution, so that layer-skip "
                                       "drafts are accepted. Rerun the same command to resume after an interrupt.")
    _data_options(a, held_out=True)
    a.add_argument("--out", required=True, metavar="DIR", help="output folder (checkpoint, then config.json + model.safetensors)")
    a.add_argument("--exit-layer", type=int, default=4, help="L, the target layers that draft (default: 4)")
    a.add_argument("--draft-vocab", type=int, default=4096,
                   help="the most frequent answer tokens it drafts, chosen after training (default: 4096)")
    a.add_argument("--epochs", type=int, default=1, help="passes over the train split (default: 1)")
    a.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (default: 0.001)")
    a.add_argument("--limit", type=int, default=None, help="train answers used (default: all)")
    a.add_argument("--sources", default="", help="only the answers to these prompt sets, comma-separated (e.g. alpaca-libre,oasst1), in both splits; default: all")
    a.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per batch (default: 1024)")
    a.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="stop with a checkpoint after this long")
    a.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    add_model_options(a)
    a.set_defaults(func=cmd_train_adapter)
    x = actions.add_parser("export", help="write trained heads in another engine's layout",
                           description="eagle3: SpecForge / SGLang / vLLM (LlamaForCausalLMEagle3; what `train eagle` "
                                       "already writes); speculators: the speculators library's EAGLE-3 format; "
                                       "vllm-medusa: vLLM's MedusaModel.")
    x.add_argument("source", help="a head folder written by `specdraft train eagle` or `train medusa`")
    x.add_argument("out", help="output folder")
    x.add_argument("--format", required=True, choices=("eagle3", "speculators", "vllm-medusa"))
    x.add_argument("--verifier", default="", help="the target's name or path, for the speculators config")
    x.set_defaults(func=cmd_train_export)
    v = actions.add_parser("eval", help="measure a trained head's held-out tau on a data folder",
                           description="The held-out measure training prints at its end (the greedy chain's "
                                       "acceptance per draft position and tau; Medusa: per head), for any trained "
                                       "folder (eagle, mtp, medusa, layer-skip; told apart by its config.json) on any "
                                       "data folder's validation answers: two heads compared on the same positions.")
    v.add_argument("head", help="a folder written by `specdraft train eagle|mtp|medusa|layer-skip` (or a shipped one)")
    _data_options(v, held_out=False)
    v.add_argument("--steps", type=int, default=6, help="draft positions measured (default: 6)")
    v.add_argument("--limit", type=int, default=None, help="validation answers used (default: all)")
    v.add_argument("--sources", default="", help="only the answers to these prompt sets, comma-separated (e.g. alpaca-libre,oasst1), in both splits; default: all")
    v.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per batch (default: 1024)")
    add_model_options(v)
    v.set_defaults(func=cmd_train_eval)
    s = actions.add_parser("summary", help="count the prompts and tokens of a data folder")
    s.add_argument("folder", help="a folder written by `specdraft train data`")
    s.set_defaults(func=cmd_train_summary)


def cmd_train_eval(args: argparse.Namespace) -> int:
    from specdraft.train.evaluate import EvalConfig, evaluate_folder

    cfg = EvalConfig(steps=args.steps, batch_tokens=args.batch_tokens, limit=args.limit, sources=_sources(args))
    kind, result = evaluate_folder(_teacher(args), args.head, args.data, cfg)
    print(f"eval {kind} {args.head}: {result.line()}")
    return 0


def cmd_train_data(args: argparse.Namespace) -> int:
    from specdraft.model.loader import load, set_threads
    from specdraft.train.data import DataConfig, generate_data
    from specdraft.train.prompts import load_training_prompts

    try:
        temperatures = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
    except ValueError:
        raise SpecdraftError(f"--temperatures must be comma-separated numbers, got {args.temperatures!r}") from None
    splits = tuple(s.strip() for s in args.split.split(",") if s.strip())
    if not splits or any(s not in ("train", "validation") for s in splits):
        raise SpecdraftError(f"--split takes train and/or validation, got {args.split!r}")
    cfg = DataConfig(max_new_tokens=args.max_new_tokens, temperatures=temperatures,
                     max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, shard_size=args.shard_size,
                     seed=args.seed, limit=args.limit, time_budget_s=args.time_budget, splits=splits)
    sources = tuple(s.strip() for s in args.sources.split(",")) if args.sources else None
    prompts = load_training_prompts(args.prompts, sources)
    set_threads(args.threads)
    loaded = load(args.model, dtype=args.dtype, device=args.device, batch_invariant=args.batch_invariant)
    report = generate_data(loaded, prompts, args.out, cfg, dtype=args.dtype)
    print(f"train data: {report.line()} -> {args.out}")
    return 0


def cmd_train_summary(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.train.data import summary

    if not Path(args.folder).is_dir():
        raise SpecdraftError(f"not a folder: {args.folder}")
    print(json.dumps(summary(args.folder), indent=2))
    return 0


def cmd_train_vocab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdraft.train.data import read_shards
    from specdraft.train.vocab import coverage_table, token_counts

    folder = Path(args.folder)
    if not folder.is_dir():
        raise SpecdraftError(f"not a folder: {folder}")
    records = read_shards(folder)
    if not records:
        raise SpecdraftError(f"{folder} has no shards yet (make them with `specdraft train data`)")
    vocab = max(max(r["response"], default=0) for r in records) + 1 if args.vocab_size is None else args.vocab_size
    train = token_counts((r["response"] for r in records if r["split"] == "train"), vocab)
    held = token_counts((r["response"] for r in records if r["split"] == "validation"), vocab)
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = coverage_table(train, held, sizes, always=tuple(args.always))
    print(f"{int(train.sum()):,} train and {int(held.sum()):,} held-out answer tokens")
    print("| draft vocabulary | train coverage | held-out coverage |\n|---|---|---|")
    for r in rows:
        print(f"| {r['size']:,} | {r['train_coverage']:.2%} | {r['held_out_coverage']:.2%} |")
    return 0


def _sources(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(s.strip() for s in args.sources.split(",") if s.strip())


def _teacher(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from specdraft.model.loader import load, set_threads

    set_threads(args.threads)
    return load(args.model, dtype=args.dtype, device=args.device)


def cmd_train_medusa(args: argparse.Namespace) -> int:
    from specdraft.train.medusa import MedusaTrainConfig, train_medusa

    cfg = MedusaTrainConfig(heads=args.heads, draft_vocab=args.draft_vocab, epochs=args.epochs, lr=args.lr,
                            batch_tokens=args.batch_tokens, seed=args.seed, limit=args.limit,
                            sources=_sources(args), time_budget_s=args.time_budget, init=args.init)
    result = train_medusa(_teacher(args), args.data, args.out, cfg, held_out=args.held_out)
    return _report("medusa", result, args.out)


def cmd_train_head(args: argparse.Namespace) -> int:
    from specdraft.train.eagle import EagleTrainConfig, train_eagle

    try:
        taps = tuple(int(t) for t in getattr(args, "taps", "").split(",") if t.strip())
    except ValueError:
        raise SpecdraftError(f"--taps must be comma-separated layer numbers, got {args.taps!r}") from None
    cfg = EagleTrainConfig(draft_vocab=args.draft_vocab, steps=args.steps, taps=taps, epochs=args.epochs, lr=args.lr,
                           batch_tokens=args.batch_tokens, seed=args.seed, limit=args.limit,
                           references=args.references, sources=_sources(args), time_budget_s=args.time_budget,
                           init=args.init)
    result = train_eagle(_teacher(args), args.data, args.out, cfg, prompts_root=args.prompts, kind=args.kind,
                         held_out=args.held_out)
    return _report(args.kind, result, args.out)


def cmd_train_adapter(args: argparse.Namespace) -> int:
    from specdraft.train.adapter import AdapterTrainConfig, train_adapter

    cfg = AdapterTrainConfig(exit_layer=args.exit_layer, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                             seed=args.seed, limit=args.limit, sources=_sources(args), time_budget_s=args.time_budget,
                             draft_vocab=args.draft_vocab)
    loaded = _teacher(args)
    if not 1 <= cfg.exit_layer < loaded.config.num_layers:
        raise SpecdraftError(f"--exit-layer must be in 1..{loaded.config.num_layers - 1}, got {cfg.exit_layer}")
    result = train_adapter(loaded, args.data, args.out, cfg, held_out=args.held_out)
    return _report("layer-skip", result, args.out)


def _report(kind: str, result: "object", out: str) -> int:
    """The held-out result of a finished training, or where an interrupted one stands."""
    if getattr(result, "positions", 0) == 0:  # stopped by the time budget: nothing evaluated yet
        print(f"train {kind}: stopped with a checkpoint in {out}; rerun the same command to resume")
    else:
        print(f"train {kind}: {result.line()} -> {out}")  # type: ignore[attr-defined]
    return 0


def cmd_train_export(args: argparse.Namespace) -> int:
    from specdraft.heads.export import export_heads

    out = export_heads(args.source, args.out, args.format, args.verifier)
    print(f"train export: {args.source} -> {out} ({args.format})")
    return 0
