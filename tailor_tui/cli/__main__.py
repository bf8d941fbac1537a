"""`python -m tailor_tui.cli` (the path before the subpackages) runs the command line, as `python -m tailor_tui` does."""

import sys

from tailor_tui.cli.main import main

if __name__ == "__main__":  # walking the package's modules imports this one too
    sys.exit(main())
