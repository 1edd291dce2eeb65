"""The one line under each panel naming the code it shows, linking to the code map
(docs/vllm-mapping.md rendered by the "Code map" page)."""
from __future__ import annotations

import streamlit as st


def code_ref(where: str, symbol: str) -> None:
    st.caption(f":material/code: `{where}` · `{symbol}` — [vLLM mapping](mapping)")
