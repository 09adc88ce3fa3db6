import sys

from specdraft.cli import main

sys.exit(main())
