"""A composition exported as a plain HF model folder: what is read from where and written where
(`plan`), a source rank's share (`rank`), the folder as a whole (`folder`).
"""
