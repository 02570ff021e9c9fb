import sys

from stockade.cli import main

sys.exit(main())
