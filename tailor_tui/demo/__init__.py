"""The demo run (`tailor-tui --make-demo`, `--demo`, `make demo-resume`): a small real DeepSpeed ZeRO-3 run of the
HF Trainer on CPU (`demo_run`), its ranks (`ranks`), a layer blown up through DeepSpeed's own API (`blowup`), known
values set at every save (`pinned`). The tests' runs of every other kind build on it, in tests/runs.py.
"""

# its public API is its modules
__all__ = ["blowup", "demo_run", "pinned", "ranks"]
