"""Saving only some rows during training: `save_rows` and the strategies (`saver`), the HF Trainer
callback (`hf`), and a run folder's saves (`run_saves`: what to resume from).
"""
