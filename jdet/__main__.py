import sys

from jdet.cli import main

sys.exit(main())
