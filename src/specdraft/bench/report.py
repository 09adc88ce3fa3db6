"""Turn saved benchmark results (results.json) into a markdown report (and plots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdraft.bench.machine import format_table
from specdraft.errors import SpecdraftError


def read_results(folder: Path) -> dict[str, Any]:
    path = folder / "results.json" if folder.is_dir() else folder
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecdraftError(f"no benchmark results at {path}") from None
    except json.JSONDecodeError as e:
        raise SpecdraftError(f"{path} is not valid JSON: {e.msg}") from None
    if (not isinstance(data, dict) or not isinstance(data.get("rows"), list)
            or not isinstance(data.get("config"), dict) or not isinstance(data.get("machine"), dict)):
        raise SpecdraftError(f"{path} does not hold specdraft benchmark results")
    return data


def header(results: dict[str, Any]) -> str:
    m, c = results["machine"], results["config"]
    model = results.get("model", {})
    return "\n".join([
        f"- model: {model.get('name', '?')} ({Path(model.get('source', '?')).name}), {c['dtype']}"
        f"{' batch-invariant' if c.get('batch_invariant') else ''} on {c['device']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads; "
        f"python {m['python']}, torch {m['torch']}, specdraft {m['specdraft']}",
        f"- {c['samples']} prompts per workload, {c['max_new_tokens']} new tokens, temperature {c['temperature']}, "
        f"seed {c['seed']}, {_repeats(c)} (median; methods in rotated order each round), warm-up excluded",
    ])


def _repeats(c: dict[str, Any]) -> str:
    batched = c.get("batched_repeats")
    if batched is None or batched == c["repeats"]:
        return f"{c['repeats']} timed repeat(s)"
    return f"{c['repeats']} timed repeat(s) at batch 1, {batched} at larger batches"


def results_table(rows: list[dict[str, Any]]) -> str:
    body = [[r["workload"], r["batch"], r["method"], r["tokens_per_s"], f"{r['speedup']:.2f}x",
             f"{r.get('decode_speedup', 0.0):.2f}x", r["tau"],
             f"{r['acceptance_rate']:.0%}" if r["base_method"] != "plain" else "-",
             f"{r['propose_s']:.1f}/{r['verify_s']:.1f}/{r['other_s']:.1f}"] for r in rows]
    return format_table(["workload", "batch", "method", "tok/s", "speedup", "decode speedup", "tau", "accept",
                         "propose/verify/other s"], body)


def peers_table(results: dict[str, Any]) -> str:
    """Each peer's speedup over its own plain decoding, beside ours at batch 1 with the same
    kind of drafts (prompt lookup: our ngram method with its defaults; draft model: ours)."""
    body = []
    for p in results.get("peers", []):
        base = "draft" if p.get("mode") == "draft model" else "ngram"
        mine = _our_row(results["rows"], p["workload"], base)
        spec = p.get("speculative_tokens_per_s", p.get("prompt_lookup_tokens_per_s", 0.0))
        best = _best_row(results["rows"], p["workload"])
        body.append([p["workload"], p["peer"], p.get("mode", "prompt lookup"), p["plain_tokens_per_s"], spec,
                     f"{p['speedup']:.2f}x", f"{mine['speedup']:.2f}x ({mine['method']})" if mine else "-",
                     f"{best['tokens_per_s']:.1f} ({best['method']})" if best else "-",
                     f"{best['tokens_per_s'] / p['plain_tokens_per_s']:.2f}x" if best and p["plain_tokens_per_s"] else "-"])
    return format_table(["workload", "peer", "drafts", "peer plain tok/s", "peer speculative tok/s",
                         "peer speedup", "specdraft speedup", "specdraft best tok/s",
                         "specdraft best / peer plain"], body)


def _best_row(rows: list[dict[str, Any]], workload: str) -> dict[str, Any] | None:
    """Our fastest batch-1 row for the workload (every method is lossless), end to end."""
    mine = [r for r in rows if r["batch"] == 1 and r["workload"] == workload and "tokens_per_s" in r]
    return max(mine, key=lambda r: r["tokens_per_s"], default=None)


def _our_row(rows: list[dict[str, Any]], workload: str, base: str) -> dict[str, Any] | None:
    """Our batch-1 row for the workload: the method named exactly ``base`` (default settings)
    if it ran, else the first row of that method."""
    mine = [r for r in rows if r["batch"] == 1 and r["workload"] == workload and r["base_method"] == base]
    return next((r for r in mine if r["method"] == base), mine[0] if mine else None)


def ceiling_table(rows: list[dict[str, Any]]) -> str:
    """Per workload (batch 1): the copy ceiling (the tau of an oracle that copies the longest
    next span from the request's own context) and the lookup ceiling (the same for an oracle
    that continues an earlier occurrence of the last token) beside the best tau a method
    reached. Results made before the lookup ceiling existed show "-" there."""
    body = []
    for r in rows:
        if r["batch"] != 1 or r["base_method"] != "plain" or not r.get("copy_ceiling_tau"):
            continue
        spec = [x for x in rows if x["batch"] == 1 and x["workload"] == r["workload"] and x["base_method"] != "plain"]
        best = max(spec, key=lambda x: x["tau"], default=None)
        body.append([r["workload"], r["copy_ceiling_tau"], r.get("lookup_ceiling_tau") or "-",
                     best["tau"] if best else "-", best["method"] if best else "-"])
    return format_table(["workload", "copy ceiling tau", "lookup ceiling tau", "best tau", "by"], body) if body else ""


def render(results: dict[str, Any]) -> str:
    rows = results["rows"]
    parts = ["# specdraft benchmark", "", header(results), "", results_table(rows)]
    ceiling = ceiling_table(rows)
    if ceiling:
        parts += ["", "## Headroom for copying (batch 1)", "",
                  "The copy ceiling is the tau of an oracle that, at each step, drafts the longest next span "
                  "of the real output (at most k tokens) found anywhere in the request's context so far: "
                  "no method that copies from the request itself can beat it (a datastore or a draft model can). "
                  "The lookup ceiling is the tau of an oracle that tries every earlier occurrence of the last "
                  "token and continues the best one: the bound for proposers that find what to copy by matching "
                  "the end of the context (ngram, suffix, lookahead), with unlimited tree width.",
                  "", ceiling]
    if results.get("peers"):
        parts += ["", "## Peers (batch 1, greedy, same weights and prompts)", "", peers_table(results)]
    for name, note in results.get("peer_notes", {}).items():
        if note != "ok":
            parts += ["", f"- peer {name}: {note}"]
    cut = {w: n for w, n in results.get("truncated", {}).items() if n}
    if cut:
        parts += ["", "Prompts cut to fit the context: " + ", ".join(f"{w}: {n}" for w, n in cut.items())]
    return "\n".join(parts) + "\n"


def write_report(folder: Path, results: dict[str, Any] | None = None) -> Path:
    results = results if results is not None else read_results(folder)
    if folder.is_file():  # given the results.json itself: write beside it
        folder = folder.parent
    from specdraft.bench.plots import write_plots

    folder.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, folder)
    text = render(results)
    if plots:
        text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    else:
        text += "\n(plots skipped: matplotlib is not installed)\n"
    path = folder / "report.md"
    path.write_text(text)
    return path
