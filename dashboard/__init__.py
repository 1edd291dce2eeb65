"""The vllm_anatomy dashboard (Streamlit). Not an installed package: `dashboard/app.py`
puts the repository root on sys.path, so pages import `dashboard.*`."""
