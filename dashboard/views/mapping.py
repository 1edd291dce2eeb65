"""Code map: docs/vllm-mapping.md (our module → vLLM's), the target of every
panel's code line."""
from __future__ import annotations

import os

import streamlit as st

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "vllm-mapping.md")


def main() -> None:
    try:
        with open(DOC, encoding="utf-8") as f:
            st.markdown(f.read())
    except OSError as e:
        st.error(f"Cannot read {DOC}: {e}")


main()
