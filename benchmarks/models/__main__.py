import sys

from benchmarks.models.builders import main

sys.exit(main())
