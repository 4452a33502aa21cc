"""Benchmarks: ``python -m stress bench {core,tasks,scale,soak}``.

They are never run by the test command (only a smoke test with tiny sizes is).
"""
