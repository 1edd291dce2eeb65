"""bench/serve_vs_vllm.py's JSON as one PNG: p99 TTFT, p99 TPOT and goodput against the offered rate.

Runbook (any machine with matplotlib; no GPU, a second or two):

    python bench/plot_serve.py [bench/results/serve_vs_vllm_h100.json] [--out bench/results/serve_vs_vllm_h100.png]

Three panels, the offered Poisson rate (requests/s) on a log axis: p99 time to first
token, p99 time per output token (both log, the SLO dashed), and goodput (requests/s
that met both SLOs; the offered rate dotted: a server keeping up sits on it). A line
per server; each server's knee (the highest rate with >= 90 % of requests in SLO) is
ringed.
"""
from __future__ import annotations

COLORS = {"ours": "tab:blue", "vllm": "tab:orange"}
LABELS = {"ours": "vllm_anatomy serve", "vllm": "vllm serve"}
PANELS = (("ttft_ms", "p99 TTFT (ms)", "slo_ttft_ms"), ("tpot_ms", "p99 TPOT (ms)", "slo_tpot_ms"),
          ("goodput_req_per_s", "goodput (req/s in SLO)", None))


def series(result: dict) -> dict[str, dict[str, list[float]]]:
    """server -> {"rate": [...], "ttft_ms": [p99...], "tpot_ms": [p99...], "goodput_req_per_s": [...],
    "knee": [rate]}: what the panels draw, rows in offered-rate order; servers that failed to start
    (no rows) are left out."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, server in result["servers"].items():
        rows = sorted(server.get("rows") or [], key=lambda r: r["offered_rate"])
        if not rows:
            continue
        out[name] = {"rate": [r["offered_rate"] for r in rows],
                     "ttft_ms": [r["ttft_ms"]["p99"] for r in rows],
                     "tpot_ms": [r["tpot_ms"]["p99"] for r in rows],
                     "goodput_req_per_s": [r["goodput_req_per_s"] for r in rows],
                     "knee": [k] if (k := server.get("knee")) is not None else []}
    return out


def plot(result: dict, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")                           # headless: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter
    drawn = series(result)
    workload = result.get("workload") or {}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for ax, (key, ylabel, slo_key) in zip(axes, PANELS):
        for name, s in drawn.items():
            color = COLORS.get(name)
            ax.plot(s["rate"], s[key], "o-", color=color, label=LABELS.get(name, name))
            for knee in s["knee"]:
                ax.plot([knee], [s[key][s["rate"].index(knee)]], "o", ms=14, mfc="none", color=color)
        if slo_key and workload.get(slo_key):
            ax.axhline(workload[slo_key], color="k", ls="--", lw=1, label="SLO")
        if key == "goodput_req_per_s":
            rates = sorted({r for s in drawn.values() for r in s["rate"]})
            ax.plot(rates, rates, "k:", lw=1, label="offered")
        else:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r for s in drawn.values() for r in s["rate"]}))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("offered rate (requests/s, Poisson)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    title = f"{result.get('device', '?')}: serving, streamed; knee ringed"
    if workload:
        title += (f" — prompts {workload.get('input_len')} tokens, {workload.get('output_len')} out, "
                  f"{workload.get('model', '')}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    from plot_scaling import json_to_png        # (bench/ is on sys.path when a bench script runs)
    json_to_png(plot, "bench/results/serve_vs_vllm_h100.json", __doc__)


if __name__ == "__main__":
    main()
