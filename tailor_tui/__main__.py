import sys

from tailor_tui.cli.main import main

sys.exit(main())
