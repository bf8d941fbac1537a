"""Real training runs on CPU for the demo and the tests: DeepSpeed and the HF Trainer (`demo_run`),
their models (`models`), Accelerate's save_state (`accelerate`).
"""

# its public API is its modules
__all__ = ["accelerate", "blowup", "demo_run", "models", "pinned", "ranks"]
