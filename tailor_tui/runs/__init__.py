"""Real training runs on CPU for the demo and the tests: DeepSpeed and the HF Trainer (`demo_run`),
their ranks (`ranks`), their models (`models`), a layer blown up through DeepSpeed's own API (`blowup`),
known values set at every save (`pinned`). What only the tests use lives in `tests/`.
"""

# its public API is its modules
__all__ = ["blowup", "demo_run", "models", "pinned", "ranks"]
