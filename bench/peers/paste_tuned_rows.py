"""Paste bench/skinny_gemm.py's TUNED_CONFIGS rows into vllm_anatomy/kernels/skinny_gemm.py.

    python bench/peers/paste_tuned_rows.py $OUT/skinny_gemm_h100.json [vllm_anatomy/kernels/skinny_gemm.py]

On the device, right after the sweep, so that the same call's tests and A/B run with the
rows it measured (the device's tree is a copy: commit the rows here afterwards, from the
JSON or the copy of the file the stage leaves under $OUT). The table's body, whatever it
holds, is replaced by the JSON's rows (None where cuBLAS won), in the JSON's order.
"""
from __future__ import annotations

import json
import re
import sys

# NOTE: the body holds no braces (rows are "(N, K, bucket): SkinnyGemmConfig(...)," or "None,"),
# so the first "}" after the opening one closes the table, empty ("{}") or not.
ANCHOR = re.compile(r"(TUNED_CONFIGS: dict\[tuple\[int, int, int\], SkinnyGemmConfig \| None\] = \{)[^{}]*\}")


def paste(rows: list[dict], source: str) -> str:
    """source with TUNED_CONFIGS' body replaced by the rows' literals."""
    if not ANCHOR.search(source):
        raise SystemExit("TUNED_CONFIGS's definition not found")
    body = "".join("\n" + r["literal"] for r in rows)
    return ANCHOR.sub(lambda m: m.group(1) + body + ("\n}" if rows else "}"), source, count=1)


def main() -> None:
    result = json.load(open(sys.argv[1]))
    path = sys.argv[2] if len(sys.argv) > 2 else "vllm_anatomy/kernels/skinny_gemm.py"
    rows = result.get("tuned_rows", [])
    with open(path) as f:
        source = f.read()
    with open(path, "w") as f:
        f.write(paste(rows, source))
    # NOTE: older JSONs have no "in_context" (each GEMM alone) and "pdl" only with --pdl (in context)
    mode = ("in context, PDL on" if result.get("pdl") else "in context, PDL off" if result.get("in_context")
            else "each GEMM alone")
    print(f"pasted {len(rows)} rows ({sum(r['wins'] for r in rows)} configs, the rest None; chosen {mode}) "
          f"into {path}")


if __name__ == "__main__":
    main()
