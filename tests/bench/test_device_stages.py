"""bench/peers/device_stages.sh, the device session's runbook as code: it parses, the stages its
header documents are the stages its `case` runs, and every repository file it names exists (a
renamed test or bench would otherwise surface only on a GPU machine, minutes into a lease)."""
from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "peers", "device_stages.sh")


def test_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_documented_stages_are_the_stages():
    text = open(SCRIPT).read()
    header = text[text.index("# Stages:"):text.index("set -uo pipefail")]
    documented = set()
    for name in re.findall(r"^#   ([a-z][a-z0-9_, ]*?)\s{2,}", header, re.M):
        documented |= {n.strip() for n in name.split(",")}
    labels = set()
    for label in re.findall(r"^  ([a-z0-9_|]+)\)$", text, re.M):
        labels |= set(label.split("|"))
    assert documented == labels == {"skinny", "fuse", "fuse_rope", "pdl", "pdltune", "incontext", "pdlx", "tracing", "gil", "breakdown", "ttft", "ttfthost", "ttftcfg", "launch", "cold", "q0", "q1",
                                     "vs", "vs2"}


def test_named_files_exist():
    text = open(SCRIPT).read()
    paths = set(re.findall(r"\b((?:bench|tests|vllm_anatomy)/[\w/]+\.(?:py|sh))\b", text))
    assert len(paths) > 15
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, missing
