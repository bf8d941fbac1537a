"""tailor-tui: compose DeepSpeed ZeRO-3 checkpoints layer by layer.

Importing the package installs the one rule that keeps the old import paths of its public API working
for one minor release (`moved`, CHANGELOG.md): no torch, no Textual, nothing else is imported here.
"""

from tailor_tui import moved

__version__ = "0.1.0"
__all__ = ["__version__"]

moved.install()
