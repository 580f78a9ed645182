import sys

from memckpt.cli.main import main

sys.exit(main())
