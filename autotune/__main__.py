import sys

from autotune.cli.command import main

sys.exit(main())
