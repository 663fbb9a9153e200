import sys

from structllm.engine.process import main

sys.exit(main())
