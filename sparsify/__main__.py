import sys

from sparsify.cli import main

sys.exit(main())
