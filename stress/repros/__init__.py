"""Minimal reproductions of runner/store problems found under stress (run them as scripts)."""
