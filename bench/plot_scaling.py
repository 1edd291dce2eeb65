"""bench/scaling.py's JSON as one PNG: throughput vs sequences and vs context, ours and vLLM.

Runbook (any machine with matplotlib; no GPU, a second or two):

    python bench/plot_scaling.py [bench/results/scaling_h200.json] [--out bench/results/scaling_h200.png]

Two panels, log-log: output tokens/s against the number of sequences (256-token
prompts, 128 output tokens) and against the prompt length (64 sequences, 128 output
tokens); a line per engine, labelled at each point with its fraction of the roofline
floor, and the floor itself dashed (bench/throughput.py's model at the rates the run
measured). An engine whose subprocess failed is left out; so is vLLM if the run had none.
"""
from __future__ import annotations

import argparse
import json
import os

ENGINES = (("vllm_anatomy", "vllm_anatomy", "tab:blue"), ("vllm", "vLLM {version}", "tab:orange"))
PANELS = (("num_seqs", "sequences ({prompt_len}-token prompts, {output_len} output tokens)"),
          ("context", "prompt tokens ({num_seqs} sequences, {output_len} output tokens)"))


def plot(result: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")                           # headless: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (series, xlabel) in zip(axes, PANELS):
        floor = result["floor"][series]
        xs = [f["x"] for f in floor]
        ax.plot(xs, [f["floor_tok_per_s"] for f in floor], "k--", lw=1, label="roofline floor")
        drawn = {key: result[key][series] for key, _, _ in ENGINES
                 if result.get(key) and "error" not in result[key]}
        for key, label, color in ENGINES:
            if key not in drawn:
                continue
            points = drawn[key]
            ys = [p["tok_per_s"] for p in points]
            ax.plot([p["x"] for p in points], ys, "o-", color=color,
                    label=label.format(version=result[key].get("settings", {}).get("version", "")))
            for i, p in enumerate(points):
                # The label goes above the point when this engine is the faster one there, below
                # when it is the slower one, so that crossing lines do not stack their labels.
                others = [q[i]["tok_per_s"] for k, q in drawn.items() if k != key and i < len(q)]
                above = all(p["tok_per_s"] >= y for y in others)
                ax.annotate(f"{100 * p['fraction_of_floor']:.0f}%", (p["x"], p["tok_per_s"]), fontsize=7,
                            color=color, textcoords="offset points", xytext=(0, 6 if above else -11),
                            ha="center")
        ax.set_xscale("log", base=2 if series == "context" else 4)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_xlabel(xlabel.format(**result["series"][series][0]))
        ax.set_ylabel("output tokens/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = f"Throughput as the work grows — {result.get('gpu') or 'CPU'}, {result['model']}"
    if result.get("smoke"):
        title += " (smoke run: nominal ceilings)"
    fig.suptitle(title + "; labels: % of the roofline floor", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def json_to_png(draw, default_json: str, description: str) -> None:
    """The command line of a bench plot: `[JSON] [--out PNG]`, draw(result, out) writes the PNG."""
    ap = argparse.ArgumentParser(description=description.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default=default_json)
    ap.add_argument("--out", help="the PNG (default: the JSON's path with .png)")
    args = ap.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    draw(result, out)
    print(f"wrote {out}")


def main() -> None:
    json_to_png(plot, "bench/results/scaling_h200.json", __doc__)


if __name__ == "__main__":
    main()
