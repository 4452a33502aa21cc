"""Test helpers for tritask and for third-party stores (never imported by runtime code)."""
