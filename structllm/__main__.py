import sys

from structllm.cli import main

sys.exit(main())
