"""Panels of the dashboard, one per file; each takes snapshot data and draws it."""
