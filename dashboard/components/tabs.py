"""The step inspector's tabs: short key -> the st.tabs label. A deep link's `tab` is the
label (st.tabs(bind="query-params") writes it); lessons and cards name tabs by key.
Plain data (no Streamlit import): the CLI lessons (lessons/_common.py) build links with it."""
TABS = {"scheduler": "Scheduler", "kv": "KV cache", "worker": "Worker (model runner)"}
